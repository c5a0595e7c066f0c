"""RefreshPolicy: first call, interval, rolling acceptance."""

import pytest

from vllm_triforce.core.refresh import RefreshPolicy


def test_first_call_then_interval():
    policy = RefreshPolicy(interval=100, acceptance_threshold=0.0)
    state = policy.new_state()
    assert policy.should_refresh(state, 500)
    policy.record_selection(state, 500)
    assert not policy.should_refresh(state, 599)
    assert policy.should_refresh(state, 600)
    policy.record_selection(state, 600)
    for _ in range(50):  # acceptance trigger off: bad rounds change nothing
        policy.record_round(state, 4, 0)
    assert not policy.should_refresh(state, 650) and state.num_refreshes == 2


def test_rolling_acceptance_below_threshold():
    policy = RefreshPolicy(interval=0, acceptance_threshold=0.5, window=4)
    state = policy.new_state()
    policy.record_selection(state, 0)
    for _ in range(3):
        policy.record_round(state, 2, 0)
    assert not policy.should_refresh(state, 10**6), "window not full yet; interval off"
    policy.record_round(state, 2, 0)
    assert policy.should_refresh(state, 10)
    policy.record_selection(state, 10)
    assert state.acceptance() is None and not policy.should_refresh(state, 10)
    for accepted in (2, 2, 2, 0):  # 6 / 8 = 0.75
        policy.record_round(state, 2, accepted)
    assert not policy.should_refresh(state, 20)
    for _ in range(2):  # window keeps the last 4 rounds: (2, 0, 0, 0) -> 2 / 8
        policy.record_round(state, 2, 0)
    assert state.acceptance() == 0.25 and policy.should_refresh(state, 20)


def test_validation():
    policy = RefreshPolicy(interval=10, acceptance_threshold=0.3)
    with pytest.raises(ValueError):
        policy.record_round(policy.new_state(), 2, 3)
    with pytest.raises(ValueError):
        RefreshPolicy(interval=10, acceptance_threshold=0.3, window=0)
