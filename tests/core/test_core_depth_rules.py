"""The depth rules that come before the clocks: no drafting where the middle
level is the target, and a request the engine limits never costs a probe."""

import pytest

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.blocks import selection_sizes
from vllm_triforce.core.controller import SpeculationController, middle_level_is_the_target
from vllm_triforce.core.plans import RETRIEVAL

MS = 1e-3


def test_the_docstring_example():
    assert middle_level_is_the_target(1548, 32, 128)   # 49 blocks of 128
    assert middle_level_is_the_target(4096, 32, 128)   # exactly the budget
    assert not middle_level_is_the_target(4097, 32, 128)  # a 129th (partial) block


@pytest.mark.parametrize("sinks, recent", [(1, 1), (2, 3)])
def test_the_rule_is_where_the_selection_keeps_every_block(sinks, recent):
    """The selection of a request that fits keeps every block below its tail (the middle
    level attends to everything); one token more and it leaves a block out."""
    blocks = BlockCounts(block_size=4, budget_blocks=sinks + recent + 4,
                         retrieval_sink_blocks=sinks, retrieval_recent_blocks=recent)
    for num_committed in range(1, 80):
        num_selected, tail_start = selection_sizes(num_committed, blocks)
        keeps_every_block = num_selected == tail_start
        assert middle_level_is_the_target(num_committed, 4, blocks.budget_blocks) \
            == keeps_every_block, num_committed


def _run(ctl, limits, steps, alpha=1.0, round_s=1 * MS):
    """A synthetic engine where drafting pays (cheap rounds, every draft accepted)."""
    req_ids = [f"r{i}" for i in range(len(limits))]
    plans = []
    for _ in range(steps):
        plan = ctl.plan(req_ids, 6, limits)
        plans.append(plan)
        active = [k for k in plan.depths if k]
        for r, k in zip(req_ids, plan.depths):
            if k:
                ctl.observe_verifications([r], [k], [int(alpha * k)])
        for _ in range(plan.max_depth):
            ctl.observe_round(RETRIEVAL, len(active), round_s, 1.0)
        ctl.observe_overhead(plan.max_depth > 0, 0.0)
        num_tokens = len(req_ids) + sum(plan.depths)
        ctl.observe_step(len(req_ids), num_tokens, 10 * MS + 0.1 * MS * num_tokens)
    return plans


def test_a_request_at_limit_zero_never_drafts_not_even_in_a_probe():
    ctl = SpeculationController(max_depth=6, has_draft=False, probe_interval=8)
    plans = _run(ctl, [0, 6], steps=80)
    assert all(p.depths[0] == 0 for p in plans)
    assert sum(p.depths[1] > 0 for p in plans) > 40  # the other one drafts where it pays


def test_a_step_where_nobody_may_draft_spends_no_probe():
    """Start-up probes draft at full depth once the plain step is timed; with every limit
    0 they never come, and the controller's estimates of drafting stay empty."""
    ctl = SpeculationController(max_depth=6, has_draft=False, probe_interval=8)
    plans = _run(ctl, [0, 0], steps=100)
    assert all(p.max_depth == 0 for p in plans)
    assert not ctl.rounds[RETRIEVAL].seen and not ctl.step.seen
    assert ctl.plain_step.seen  # plain steps are still measured
    later = _run(ctl, [0, 6], steps=3)  # the second request outgrew the budget
    assert later[1].depths == (0, 6)  # the start-up probe, for it alone


def test_a_limit_caps_the_depth_the_controller_chooses():
    ctl = SpeculationController(max_depth=6, has_draft=False, probe_interval=1000)
    plans = _run(ctl, [2, 6], steps=40)
    assert max(p.depths[0] for p in plans) == 2
    assert max(p.depths[1] for p in plans) == 6
