"""engine/depth.py: the glue between the proposer's clocks and core/controller.py."""

from vllm_triforce.engine.depth import DepthChooser
from vllm_triforce.engine.stats import TriForceStats


def test_fixed_depth_when_not_adaptive():
    chooser = DepthChooser(False, 6, True, TriForceStats())
    assert chooser.plan(["a", "b"], 4) == ([4, 4], True)


def test_tensor_parallel_ranks_follow_rank0():
    """Every rank plans, then takes rank 0's plan: its own clocks never decide alone."""
    seen = []

    def share(obj):
        seen.append(obj)
        return [1, 0], False  # what rank 0 decided

    chooser = DepthChooser(True, 6, False, TriForceStats(), share=share)
    assert chooser.plan(["a", "b"], 6) == ([1, 0], False)
    assert seen and seen[0][0] == [0, 0]  # this rank's own start-up step was overridden


def test_step_time_and_rates_come_from_pure_decode_steps():
    """A prefill step, the first decode after it, and the proposer's time on a prefill step
    are not timed; the decode steps after are."""
    stats = TriForceStats()
    chooser = DepthChooser(True, 4, False, stats)
    ctl = chooser.controller
    chooser.begin(0.0, ["a"], num_tokens=2048, emitted=2, pure_decode=False, verified=[],
                  live_req_ids=["a"])  # a prefill: not timed
    chooser.plan(["a"], 4)
    chooser.end(drafting=True, start=chooser._last_start - 0.3)  # 0.3 s summarising the prompt
    assert not ctl.step.seen and not ctl.active.n and not ctl.idle.n
    chooser.begin(chooser._last_end + 0.01, ["a"], num_tokens=5, emitted=3, pure_decode=True,
                  verified=[("a", 4, 2)], live_req_ids=["a"])  # first decode: still paying
    assert not ctl.step.seen
    assert ctl.requests["a"].accepted[:3] == [1.0, 1.0, 0.0]  # acceptance always counts
    chooser.plan(["a"], 4)
    chooser.end(drafting=True, start=chooser._last_start)
    assert ctl.active.n == 1
    last_end = chooser._last_end
    chooser.begin(last_end + 0.5, ["a"], num_tokens=5, emitted=3, pure_decode=True,
                  verified=[("a", 4, 2)], live_req_ids=["a"])
    assert ctl.step.predict(5) == 0.5  # 5 tokens for 1 request: verification
    assert not ctl.plain_step.seen
    chooser.plan(["a"], 4)
    chooser.end(drafting=False, start=last_end + 0.5)
    assert stats.achieved_tokens_per_s > 0 and stats.plain_steps + stats.drafting_steps == 3


def test_a_prefill_only_step_plans_nothing():
    chooser = DepthChooser(True, 4, False, TriForceStats())
    assert chooser.plan([], 4) == ([], False)
    assert chooser.controller._num_plans == 0  # no start-up probe used up


def test_a_joining_request_is_not_timed():
    """The gap before a step where a request joined may hold idle time."""
    chooser = DepthChooser(True, 4, False, TriForceStats())
    chooser.begin(0.0, ["a"], num_tokens=1, emitted=1, pure_decode=True, verified=[],
                  live_req_ids=["a"])
    chooser.plan(["a"], 4)
    chooser.end(drafting=False, start=0.0)
    chooser.begin(chooser._last_end + 30.0, ["a", "b"], num_tokens=2, emitted=2,
                  pure_decode=True, verified=[], live_req_ids=["a", "b"])
    assert not chooser.controller.step.seen


def test_at_most_max_drafting_requests_draft_in_a_step():
    """The cap engine/memory.py reserves for: the first MAX_DRAFTING_REQUESTS drafting
    requests keep their depths, the rest run plain; beyond the cap nothing TriForce
    reserves grows with max_num_seqs (the hand-off buffer has a row per drafting request)."""
    from vllm_triforce.engine.depth import MAX_DRAFTING_REQUESTS, cap_drafting
    from vllm_triforce.engine.memory import vocabulary_rows

    assert cap_drafting([2, 0, 3, 1], 2) == [2, 0, 3, 0]
    stats = TriForceStats()
    many = [str(i) for i in range(MAX_DRAFTING_REQUESTS + 8)]
    depths, _ = DepthChooser(False, 6, True, stats).plan(many, 4)
    assert depths == [4] * MAX_DRAFTING_REQUESTS + [0] * 8
    assert stats.depth_counts[4] == MAX_DRAFTING_REQUESTS and stats.depth_counts[0] == 8
    assert vocabulary_rows(1024, 6, 2) == vocabulary_rows(MAX_DRAFTING_REQUESTS, 6, 2)
    assert vocabulary_rows(MAX_DRAFTING_REQUESTS, 6, 2) > vocabulary_rows(16, 6, 2)


def _chooser(has_draft=False, budget_blocks=5):
    from vllm_triforce.config import BlockCounts

    blocks = BlockCounts(block_size=32, budget_blocks=budget_blocks, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    return DepthChooser(True, 4, has_draft, TriForceStats(), blocks=blocks)


def test_a_request_whose_context_fits_the_budget_gets_depth_zero():
    """Budget 5 blocks of 32 = 160 tokens: 160 committed tokens fit, 161 do not. A forced
    schedule (the controller's test hook) is cut to 0 for the fitting one."""
    chooser = _chooser()
    chooser.controller.forced = [4]
    assert chooser.plan(["a", "b"], 4, num_committed=[160, 161]) == ([0, 4], False)
    assert chooser.plan(["a"], 4, num_committed=[100]) == ([0], False)


def test_a_seeded_request_drafts_full_depth_once_it_outgrows_the_budget_whatever_the_clocks():
    """The controller's start-up (no step timed yet) keeps unseeded requests plain; a
    seeded one's depth is its rule's: 0 while it fits, the step's full depth after, with
    every level."""
    chooser = _chooser(has_draft=True)
    depths, use_draft = chooser.plan(["s", "u", "f"], 4, num_committed=[161, 161, 100],
                                     seeded=[True, False, True])
    assert (depths, use_draft) == ([4, 0, 0], True)
    chooser.controller.forced = [1]  # whatever the controller decides for the others
    depths, _ = chooser.plan(["s", "u"], 3, num_committed=[170, 170], seeded=[True, False])
    assert depths == [3, 1]


def test_the_drafting_cap_admits_seeded_requests_first():
    from vllm_triforce.engine.depth import MAX_DRAFTING_REQUESTS, cap_drafting

    assert cap_drafting([2, 0, 3, 1], 2, first=[False, False, False, True]) == [2, 0, 0, 1]
    chooser = _chooser()
    chooser.controller.forced = [4]
    num = MAX_DRAFTING_REQUESTS + 4
    seeded = [i >= 4 for i in range(num)]  # the newest 32 are seeded
    depths, _ = chooser.plan([str(i) for i in range(num)], 4, num_committed=[500] * num,
                             seeded=seeded)
    assert depths == [0] * 4 + [4] * MAX_DRAFTING_REQUESTS


def test_without_adaptive_every_request_keeps_the_fixed_depth():
    """`adaptive: false` is fixed-gamma TriForce, the reference: no budget rule."""
    from vllm_triforce.config import BlockCounts

    blocks = BlockCounts(block_size=32, budget_blocks=5, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    chooser = DepthChooser(False, 4, False, TriForceStats(), blocks=blocks)
    assert chooser.plan(["a", "b"], 4, num_committed=[10, 500], seeded=[True, False]) \
        == ([4, 4], False)
