"""The engine side of core/controller.py: clocks and counts in, per-request depths out.

Timeline of the proposer inside vLLM's sync loop (vLLM 0.32 V1 runner, async scheduling
off), step s:

    ... propose(s-1) returns | vLLM step s: schedule, full-cache pass over 1 + k tokens per
    request, rejection sampling | propose(s) starts: commit, plan, middle rounds | returns

so vLLM's own cost of a step is the wall time from the end of one `propose` to the start
of the next, and a whole cycle (what tokens per second divide by) runs from one start to
the next. Only steps whose every request ran a decode or verification, after a step that
did too and had the same requests, are timed: a prefill chunk is not what a draft depth
buys, the first decode after one still pays for the prefill's output (measured: Qwen2.5
1.5B at 4K, 316 ms against 254 ms for the next plain steps), and a request joining means
the engine may have sat idle in between (between two `generate` calls, or a server
waiting for work). Likewise the proposer's own time counts as per-step overhead only on
decode steps: on a prefill step it summarises the prompt's keys (320 ms in the same run,
which once priced plain decoding at half its speed).

Tensor parallelism: the estimates rest on each rank's own clocks, so ranks could choose
differently, and the middle passes (whose collectives must match across ranks) would then
differ. Rank 0's plan is broadcast to the others every step (`share`, vLLM's
`GroupCoordinator.broadcast_object` over the CPU group).
"""

from __future__ import annotations

import math
import time

from vllm_triforce.core.controller import (DRAFT, RETRIEVAL, DecayedMean, Plan,
                                            SpeculationController)


# At most this many requests draft in one step (engine/memory.py reserves the middle rounds'
# vocabulary-wide rows for this many, not for every one of max_num_seqs).
MAX_DRAFTING_REQUESTS = 32


def cap_drafting(depths: list[int], cap: int = MAX_DRAFTING_REQUESTS) -> list[int]:
    """At most `cap` positive depths: the first `cap` drafting requests in batch order
    (vLLM's, oldest first) keep theirs, the others run a plain step.
    Example: cap_drafting([2, 0, 3, 1], 2) -> [2, 0, 3, 0]."""
    out, kept = [], 0
    for k in depths:
        keep = k > 0 and kept < cap
        kept += keep
        out.append(k if keep else 0)
    return out


class DepthChooser:
    """Per step: `begin` (measurements of the step that just ran), `plan`, one
    `round_done` per middle round, `end`. With `adaptive` false every decoding request
    gets the step's full depth and every level, as a fixed-gamma TriForce. Either way at
    most MAX_DRAFTING_REQUESTS requests draft in a step (`cap_drafting`)."""

    def __init__(self, adaptive: bool, max_depth: int, has_draft: bool, stats, share=None):
        self.adaptive = adaptive
        self.share = share  # obj -> rank 0's obj, on every rank (None: one rank)
        self.has_draft = has_draft
        self.controller = SpeculationController(max_depth, has_draft)
        self.stats = stats
        self.achieved_tokens = DecayedMean(decay=0.9)  # tokens per cycle ...
        self.achieved_seconds = DecayedMean(decay=0.9)  # ... and its seconds
        self.predicted = DecayedMean(decay=0.9)
        self._last_start: float | None = None
        self._last_end: float | None = None
        self._plan: Plan | None = None
        self._round_seconds = 0.0
        self._last_req_ids: set[str] = set()
        self._last_pure = False     # the previous step was a pure decode step
        self._decode_step = False   # this step's batch is one (its overhead is measured)

    def begin(self, start: float, req_ids: list[str], num_tokens: int, emitted: int,
              pure_decode: bool, verified: list[tuple[str, int, int]], live_req_ids) -> None:
        """`req_ids`: the requests of vLLM's pass; `num_tokens`: its query tokens; `emitted`:
        tokens it committed; `verified`: (req_id, drafts verified, accepted) per request."""
        self.controller.retain(live_req_ids)
        for req_id, num_verified, num_accepted in verified:
            self.controller.observe_verification(req_id, num_verified, num_accepted)
        same_requests = set(req_ids) <= self._last_req_ids
        timed = (pure_decode and self._last_pure and same_requests
                 and self._last_end is not None)
        self._last_req_ids = set(req_ids)
        self._last_pure = self._decode_step = pure_decode
        if timed:
            self.controller.observe_step(len(req_ids), num_tokens, start - self._last_end)
            self.achieved_tokens.observe(emitted)
            self.achieved_seconds.observe(start - self._last_start)
            if self._plan is not None and not math.isnan(self._plan.tokens_per_s):
                self.predicted.observe(self._plan.tokens_per_s)
        self._last_start = start
        self._round_seconds = 0.0
        self._plan = None

    def plan(self, req_ids: list[str], max_depth: int) -> tuple[list[int], bool]:
        """(depth per decoding request, whether the small draft runs this step)."""
        if not req_ids:  # only prefill chunks: nothing to decide, no probe used up
            return [], False
        if not self.adaptive:
            depths, use_draft = [max_depth] * len(req_ids), self.has_draft
        else:
            self._plan = self.controller.plan(req_ids, max_depth)
            depths, use_draft = list(self._plan.depths), self._plan.mode == DRAFT
            if self.share is not None:
                depths, use_draft = self.share((depths, use_draft))
        depths = cap_drafting(depths)
        self.stats.record_depths(depths)
        return depths, use_draft

    def round_done(self, use_draft: bool, num_active: int, seconds: float,
                   tokens_per_request: float) -> None:
        self._round_seconds += seconds
        if self.adaptive:
            self.controller.observe_round(DRAFT if use_draft else RETRIEVAL, num_active,
                                          seconds, tokens_per_request)

    def end(self, drafting: bool, start: float, one_time: float = 0.0) -> None:
        """`one_time`: seconds of this step's work that a request pays once, not per
        drafting step (the lazy summaries of the blocks it completed since it last
        selected: after a plain stretch, all of that stretch's at once):
        left out of the drafting overhead the controller weighs depths with."""
        self._last_end = time.perf_counter()
        if self.adaptive and self._decode_step:
            self.controller.observe_overhead(
                drafting, self._last_end - start - self._round_seconds - one_time)
        self.stats.predicted_tokens_per_s = self.predicted.value or 0.0
        tokens, seconds = self.achieved_tokens.value, self.achieved_seconds.value
        self.stats.achieved_tokens_per_s = tokens / seconds if tokens and seconds else 0.0
