"""RefreshPolicy: first call, interval (at a step's start and between middle rounds),
rolling acceptance."""

import pytest

from vllm_triforce.core.refresh import RefreshPolicy


def test_first_call_then_interval():
    policy = RefreshPolicy(interval=100, acceptance_threshold=0.0)
    state = policy.new_state()
    assert policy.due_at_start([state], [500])[0]
    policy.record_selections([state], [500])
    assert not policy.due_at_start([state], [599])[0]
    assert policy.due_at_start([state], [600])[0]
    policy.record_selections([state], [600])
    for _ in range(50):  # acceptance trigger off: bad rounds change nothing
        policy.record_rounds([state], [4], [0])
    assert not policy.due_at_start([state], [650])[0] and policy.num_refreshes(state) == 2


def test_rolling_acceptance_below_threshold():
    policy = RefreshPolicy(interval=0, acceptance_threshold=0.5, window=4)
    state = policy.new_state()
    policy.record_selections([state], [0])
    for _ in range(3):
        policy.record_rounds([state], [2], [0])
    assert not policy.due_at_start([state], [10**6])[0], "window not full yet; interval off"
    policy.record_rounds([state], [2], [0])
    assert policy.due_at_start([state], [10])[0]
    policy.record_selections([state], [10])
    assert policy.acceptance(state) is None and not policy.due_at_start([state], [10])[0]
    for accepted in (2, 2, 2, 0):  # 6 / 8 = 0.75
        policy.record_rounds([state], [2], [accepted])
    assert not policy.due_at_start([state], [20])[0]
    for _ in range(2):  # window keeps the last 4 rounds: (2, 0, 0, 0) -> 2 / 8
        policy.record_rounds([state], [2], [0])
    assert policy.acceptance(state) == 0.25 and policy.due_at_start([state], [20])[0]


def test_rows_are_reused_and_many_requests_are_judged_at_once():
    """A batch's requests in one call, each its own row; a released row starts clean."""
    policy = RefreshPolicy(interval=0, acceptance_threshold=0.5, window=2)
    states = [policy.new_state() for _ in range(40)]  # past the first capacity
    assert len(set(states)) == 40
    policy.record_selections(states, [5] * 40)
    for _ in range(3):
        policy.record_rounds(states, [4] * 40, [4 if i % 2 else 0 for i in range(40)])
    due = policy.due_at_start(states, [9] * 40)
    assert due.tolist() == [i % 2 == 0 for i in range(40)]
    policy.release(states[:1])
    again = policy.new_state()
    assert again == states[0] and policy.acceptance(again) is None
    assert policy.due_at_start([again], [9])[0]  # no selection yet


def test_validation():
    policy = RefreshPolicy(interval=10, acceptance_threshold=0.3)
    with pytest.raises(ValueError):
        policy.record_rounds([policy.new_state()], [2], [3])
    with pytest.raises(ValueError):
        RefreshPolicy(interval=10, acceptance_threshold=0.3, window=0)


def test_middle_rounds_refresh_by_the_same_interval():
    """Between rounds the newest middle token's query re-selects every `interval` tokens;
    a selection made from a token vLLM then rejected is replaced at the next step."""
    every = RefreshPolicy(interval=1, acceptance_threshold=0.0)
    state = every.new_state()
    assert not every.due_in_middle([state], [10])[0]  # no selection yet: the step's start makes one
    every.record_selections([state], [10])  # from the query at position 9 (committed)
    assert every.due_in_middle([state], [11])[0]      # one middle token later
    every.record_selections([state], [13])  # from middle token 12
    assert every.due_at_start([state], [11])[0]     # vLLM kept only up to 10: 12 was rejected
    sparse = RefreshPolicy(interval=64, acceptance_threshold=0.0)
    state = sparse.new_state()
    sparse.record_selections([state], [10])
    assert not sparse.due_in_middle([state], [73])[0] and sparse.due_in_middle([state], [74])[0]
    never = RefreshPolicy(interval=0, acceptance_threshold=0.0)
    state = never.new_state()
    never.record_selections([state], [10])
    assert not never.due_in_middle([state], [10**6])[0]
    assert not never.due_at_start([state], [10**6])[0]
