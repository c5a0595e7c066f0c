"""engine/depth.py: the glue between the proposer's clocks and core/controller.py."""

import numpy as np
import pytest

from engine_helpers import schedule_depths
from vllm_triforce.engine.depth import DepthChooser, Verified
from vllm_triforce.engine.stats import TriForceStats


def step_of(chooser: DepthChooser, start: float = 0.0, req_ids=(), pure_decode=False,
            num_tokens=0, emitted=0, verified=()):
    """`chooser.begin` for a step after vLLM's pass over `req_ids`; `verified`: (req_id,
    drafts verified, accepted) per request."""
    ids, num_verified, num_accepted = zip(*verified) if verified else ((), (), ())
    return chooser.begin(start, list(req_ids), num_tokens=num_tokens, emitted=emitted,
                         pure_decode=pure_decode,
                         verified=Verified(list(ids), np.array(num_verified, np.int64),
                                           np.array(num_accepted, np.int64)),
                         live_req_ids=list(req_ids))


def plan(chooser: DepthChooser, *args, **kwargs):
    """The plan of a fresh step of `chooser`."""
    return step_of(chooser).plan(*args, **kwargs)


def test_fixed_depth_when_not_adaptive():
    chooser = DepthChooser(6, True, TriForceStats(), fixed_depth=6)
    assert plan(chooser, ["a", "b"], 4) == ([4, 4], True)


def test_a_fixed_depth_overrides_the_controller_until_it_is_lifted():
    """`fix` (the proposer's `set_fixed_depth`): that depth, within the step's bound, with
    every level and no rule but plain sampling's; None: the configured behaviour again."""
    chooser = DepthChooser(6, True, TriForceStats())
    assert plan(chooser, ["a", "b"], 6) == ([0, 0], False)  # the controller's start-up
    chooser.fix(3)
    assert plan(chooser, ["a", "b", "c"], 6, plain=[False, True, False]) == ([3, 0, 3], True)
    assert plan(chooser, ["a"], 2) == ([2], True)
    chooser.fix(None)
    assert plan(chooser, ["a", "b"], 6) == ([0, 0], False)
    fixed = DepthChooser(6, False, TriForceStats(), fixed_depth=6)  # `adaptive: false`
    fixed.fix(0)
    assert plan(fixed, ["a"], 6) == ([0], False)
    fixed.fix(None)
    assert plan(fixed, ["a"], 6) == ([6], False)


def test_set_fixed_depth_refuses_what_is_not_a_depth():
    from vllm_triforce.engine.proposer import TriForceProposer

    proposer = TriForceProposer.__new__(TriForceProposer)  # no engine: the check comes first
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="set_fixed_depth"):
            proposer.set_fixed_depth(bad)


def test_tensor_parallel_ranks_follow_rank0():
    """Every rank plans, then takes rank 0's plan: its own clocks never decide alone."""
    seen = []

    def share(obj):
        seen.append(obj)
        return [1, 0], False  # what rank 0 decided

    chooser = DepthChooser(6, False, TriForceStats(), share=share)
    assert plan(chooser, ["a", "b"], 6) == ([1, 0], False)
    assert seen and seen[0][0] == [0, 0]  # this rank's own start-up step was overridden


def test_step_time_and_rates_come_from_pure_decode_steps():
    """A prefill step, the first decode after it, and the proposer's time on a prefill step
    are not timed; the decode steps after are."""
    stats = TriForceStats()
    chooser = DepthChooser(4, False, stats)
    ctl = chooser.controller
    step = step_of(chooser, 0.0, ["a"], num_tokens=2048, emitted=2)  # a prefill: not timed
    step.plan(["a"], 4)
    step.end(drafting=True)  # its time, the prompt's fold, is no decode overhead
    assert not ctl.step.seen and not ctl.active.n and not ctl.idle.n
    step = step_of(chooser, chooser._last.end + 0.01, ["a"], pure_decode=True, num_tokens=5,
                   emitted=3, verified=[("a", 4, 2)])  # first decode: still paying
    assert not ctl.step.seen
    assert ctl.requests.accepted_of("a")[:3].tolist() == [1.0, 1.0, 0.0]  # acceptance always counts
    step.plan(["a"], 4)
    step.end(drafting=True)
    assert ctl.active.n == 1
    last_end = chooser._last.end
    step = step_of(chooser, last_end + 0.5, ["a"], pure_decode=True, num_tokens=5, emitted=3,
                   verified=[("a", 4, 2)])
    assert ctl.step.predict(5) == 0.5  # 5 tokens for 1 request: verification
    assert not ctl.plain_step.seen
    step.plan(["a"], 4)
    step.end(drafting=False)
    assert stats.achieved_tokens_per_s > 0 and stats.plain_steps + stats.drafting_steps == 3


def test_a_prefill_only_step_plans_nothing():
    chooser = DepthChooser(4, False, TriForceStats())
    assert plan(chooser, [], 4) == ([], False)
    assert chooser.controller._num_plans == 0  # no start-up probe used up


def test_a_joining_request_is_not_timed():
    """The gap before a step where a request joined may hold idle time."""
    chooser = DepthChooser(4, False, TriForceStats())
    step = step_of(chooser, 0.0, ["a"], pure_decode=True, num_tokens=1, emitted=1)
    step.plan(["a"], 4)
    step.end(drafting=False)
    step_of(chooser, chooser._last.end + 30.0, ["a", "b"], pure_decode=True, num_tokens=2,
            emitted=2)
    assert not chooser.controller.step.seen


def test_steps_at_a_fixed_depth_teach_the_controller_no_rounds_and_no_cycle():
    """With a fixed depth the controller decides nothing, so neither a round's time nor a
    cycle is held to a plan of its; vLLM's step time and the acceptance still count."""
    chooser = DepthChooser(4, False, TriForceStats(), fixed_depth=4)
    ctl = chooser.controller
    for _ in range(3):
        start = chooser._last.end + 0.5 if chooser._last else 0.0
        step = step_of(chooser, start, ["a"], pure_decode=True, num_tokens=5, emitted=3,
                       verified=[("a", 4, 2)])
        assert step.plan(["a"], 4) == ([4], False)
        step.round_done(False, 1, 0.01, 1.0)
        step.end(drafting=True)
    assert ctl.step.predict(5) == 0.5 and ctl.requests.tried_of("a")[0] > 0
    assert not ctl.rounds["retrieval"].seen and not ctl.active.n and not ctl.realised.n


def test_at_most_max_drafting_requests_draft_in_a_step():
    """The cap the memory plan reserves for (engine/memory.py `Sizing.drafting`): the first
    `max_drafting` drafting requests keep their depths, the rest run plain; a pass through
    per-layer builders holds at most BUILDER_PASS_REQUESTS requests whatever max_num_seqs."""
    from vllm_triforce.engine.depth import cap_drafting
    from vllm_triforce.engine.memory import vocabulary_rows
    from vllm_triforce.engine.shape import BUILDER_PASS_REQUESTS, pass_limits

    CAP = 32

    assert cap_drafting([2, 0, 3, 1], 2) == [2, 0, 3, 0]
    stats = TriForceStats()
    many = [str(i) for i in range(CAP + 8)]
    depths, _ = plan(DepthChooser(6, True, stats, fixed_depth=6,
                                  max_drafting=CAP), many, 4)
    assert depths == [4] * CAP + [0] * 8
    assert stats.depth_counts[4] == CAP and stats.depth_counts[0] == 8
    assert pass_limits(1024, 8192, 2).requests == BUILDER_PASS_REQUESTS
    assert vocabulary_rows(CAP, 6, 2) > vocabulary_rows(16, 6, 2)


def _chooser(has_draft=False, budget_blocks=5, max_drafting=None):
    from vllm_triforce.config import BlockCounts

    blocks = BlockCounts(block_size=32, budget_blocks=budget_blocks, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    return DepthChooser(4, has_draft, TriForceStats(), blocks=blocks, max_drafting=max_drafting)


def test_a_request_whose_context_fits_the_budget_gets_depth_zero():
    """Budget 5 blocks of 32 = 160 tokens: 160 committed tokens fit, 161 do not. A
    scheduled controller (`schedule_depths`) is cut to 0 for the fitting one."""
    chooser = _chooser()
    schedule_depths(chooser.controller, [4])
    assert plan(chooser, ["a", "b"], 4, num_committed=[160, 161]) == ([0, 4], False)
    assert plan(chooser, ["a"], 4, num_committed=[100]) == ([0], False)


def test_a_seeded_request_drafts_full_depth_once_it_outgrows_the_budget_whatever_the_clocks():
    """The controller's start-up (no step timed yet) keeps unseeded requests plain; a
    seeded one's depth is its rule's: 0 while it fits, the step's full depth after, with
    every level."""
    chooser = _chooser(has_draft=True)
    depths, use_draft = plan(chooser, ["s", "u", "f"], 4, num_committed=[161, 161, 100],
                             seeded=[True, False, True])
    assert (depths, use_draft) == ([4, 0, 0], True)
    schedule_depths(chooser.controller, [1])  # whatever the controller decides for the others
    depths, _ = plan(chooser, ["s", "u"], 3, num_committed=[170, 170], seeded=[True, False])
    assert depths == [3, 1]


def test_the_drafting_cap_admits_seeded_requests_first():
    from vllm_triforce.engine.depth import cap_drafting

    CAP = 32
    assert cap_drafting([2, 0, 3, 1], 2, first=[False, False, False, True]) == [2, 0, 0, 1]
    chooser = _chooser(max_drafting=CAP)
    schedule_depths(chooser.controller, [4])
    num = CAP + 4
    seeded = [i >= 4 for i in range(num)]  # the newest 32 are seeded
    depths, _ = plan(chooser, [str(i) for i in range(num)], 4, num_committed=[500] * num,
                     seeded=seeded)
    assert depths == [0] * 4 + [4] * CAP


def test_without_adaptive_every_request_keeps_the_fixed_depth():
    """`adaptive: false` is fixed-gamma TriForce, the reference: no budget rule."""
    from vllm_triforce.config import BlockCounts

    blocks = BlockCounts(block_size=32, budget_blocks=5, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    chooser = DepthChooser(4, False, TriForceStats(), fixed_depth=4, blocks=blocks)
    assert plan(chooser, ["a", "b"], 4, num_committed=[10, 500], seeded=[True, False]) \
        == ([4, 4], False)


def test_a_schedule_varies_depths_within_and_across_steps_and_stays_within_bounds():
    """The tests' `schedule_depths`: request i of the n-th plan gets depths[(n + i) % 3],
    cut to the step's bound."""
    from vllm_triforce.core.controller import SpeculationController

    ctl = SpeculationController(max_depth=4, has_draft=True)
    schedule_depths(ctl, [3, 0, 6])
    depths = [ctl.plan(["a", "b"], 4).depths for _ in range(4)]
    assert depths == [(3, 0), (0, 4), (4, 3), (3, 0)]


def test_a_plain_step_counts_as_its_depth_list_would():
    """`TriForceStats.record_plain(n)` is `record_depths([0] * n)`, without the list."""
    from vllm_triforce.engine.stats import TriForceStats

    listed, counted = TriForceStats(), TriForceStats()
    for n in (2, 0, 3):
        listed.record_depths([0] * n)
        counted.record_plain(n)
    assert counted.snapshot() == listed.snapshot()
    assert counted.depth_counts == [5] and counted.plain_steps == 2
    listed.record_depths([0, 2])
    counted.record_depths([0, 2])
    counted.record_plain(1)
    listed.record_depths([0])
    assert counted.snapshot() == listed.snapshot()



def test_a_plan_made_ahead_is_the_steps_plan_cut_to_its_bound():
    """`plan_ahead` (during vLLM's pass) plans with the controller once; the step that
    begins after the pass takes that plan, cut to vLLM's bound, without planning again."""
    chooser = _chooser()
    schedule_depths(chooser.controller, [3, 0])
    assert chooser.plan_ahead(["a", "b"], 4, [500, 500], [False, False])  # [3, 0]: drafts
    step = step_of(chooser, 0.0, ["a", "b"])
    assert step.plan(["a", "b"], 2) == ([2, 0], False)  # taken, cut to the step's bound 2
    assert not chooser.planned_ahead
    assert plan(chooser, ["a", "b"], 4) == ([0, 3], False)  # the next plan, made afresh
    # a plan made ahead for other requests is not taken: that step plans itself
    assert chooser.plan_ahead(["c"], 4, [500], [False])  # the schedule's third plan: [3]
    assert plan(chooser, ["a"], 4) == ([0], False)  # its fourth, not c's
    assert not chooser.planned_ahead


def test_a_plain_step_planned_ahead_is_timed_and_held_to_the_controllers_plan():
    """A step the controller kept plain by a plan made ahead (engine/plain_steps.py)
    takes that plan (`take_plan_ahead`), so its overhead counts as a plain step's; the
    cycle before it is held to the rate its own plan expected, not to the new plan's."""
    chooser = _chooser()
    ctl = chooser.controller
    step = step_of(chooser, 0.0, ["a"], pure_decode=True, num_tokens=1, emitted=1)
    step.plan(["a"], 4, num_committed=[500])
    ctl._expected = 50.0  # as if that step's plan expected 50 tokens/s
    step.end(drafting=False)
    schedule_depths(ctl, [0])
    assert not chooser.plan_ahead(["a"], 4, [501], [False])
    ctl._expected = 999.0  # as if the plan made ahead expected its own rate
    seen = []
    ctl.observe_cycle = lambda tokens, seconds, expected: seen.append(expected)
    step = step_of(chooser, chooser._last.end + 0.02, ["a"], pure_decode=True, num_tokens=1,
                   emitted=1)
    assert seen == [50.0]  # held to the plan of the cycle that ended
    step.take_plan_ahead(["a"])
    assert step.controller_plan is not None and not chooser.planned_ahead
    idle = ctl.idle.n
    step.end(drafting=False)
    assert ctl.idle.n == idle + 1  # a plain step's overhead, as if planned in `propose`
