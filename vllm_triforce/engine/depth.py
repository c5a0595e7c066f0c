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
decode steps: on a prefill step it summarises the prompt's keys (320 ms at that shape;
counted as decode overhead it would price plain decoding at half its speed).

Two rules come before the clocks (`DepthChooser.plan`):
- a request whose committed context fits the retrieval cache decodes plainly
  (core/controller.middle_level_is_the_target): the controller gets a limit of 0 for it;
- a seeded sampled request (vLLM keeps a generator of its own for it) never gets a
  clock-based depth: it drafts the step's full depth once its context outgrows the budget,
  0 while it fits, always with every level (the small draft too, where there is one). A
  different depth or mode consumes its generator differently (vLLM's rejection sampler, the
  middle rounds' draws), so this is what makes its text a function of its prompt,
  parameters and seed alone: not of clocks, other requests or the engine's history. The
  drafting cap admits seeded requests first; the guarantee holds while no more seeded
  requests draft in one step than the cap (MAX_DRAFTING_REQUESTS, or the memory plan's
  smaller one; past it, which ones draft depends on the batch, logged once), and with
  vLLM's Dynamic SD table (a depth that depends on the batch size) per batch size only.
  Greedy requests need no rule: their tokens are plain vLLM's whatever the depth.
- a request with a sampling setting vLLM's rejection sampler does not apply to drafted
  rows (`min_p`, `logit_bias`: `decodes_plainly`) gets depth 0 every step, with or without
  the controller: vLLM's plain sampler alone picks its tokens (patches/plain_params.py).

Tensor parallelism: the estimates rest on each rank's own clocks, so ranks could choose
differently, and the middle passes (whose collectives must match across ranks) would then
differ. Rank 0's plan is broadcast to the others every step (`share`, vLLM's
`GroupCoordinator.broadcast_object` over the CPU group).
"""

from __future__ import annotations

import math
import time

from vllm.logger import init_logger

from vllm_triforce.core.controller import SpeculationController, middle_level_is_the_target
from vllm_triforce.core.plans import DRAFT, RETRIEVAL, Plan
from vllm_triforce.core.estimates import DecayedMean
from vllm_triforce.engine.buffers import MAX_DRAFTING_REQUESTS

logger = init_logger("vllm.triforce")




def cap_drafting(depths: list[int], cap: int = MAX_DRAFTING_REQUESTS,
                 first: list[bool] | None = None) -> list[int]:
    """At most `cap` positive depths: the drafting requests marked in `first` (seeded
    ones, whose text must not depend on the others), then the rest, each in batch order
    (vLLM's, oldest first), keep theirs; the others run a plain step.
    Examples: cap_drafting([2, 0, 3, 1], 2) -> [2, 0, 3, 0];
    cap_drafting([2, 0, 3, 1], 2, first=[False, False, False, True]) -> [2, 0, 0, 1]."""
    first = first or [False] * len(depths)
    order = ([i for i, f in enumerate(first) if f]
             + [i for i, f in enumerate(first) if not f])
    out, kept = [0] * len(depths), 0
    for i in order:
        if depths[i] > 0 and kept < cap:
            out[i], kept = depths[i], kept + 1
    return out


def decodes_plainly(params) -> bool:
    """Whether a request's SamplingParams need vLLM's plain sampler for every token: vLLM's
    rejection sampler applies neither min_p nor logit_bias to drafted rows, its plain
    sampler (the only one a request without drafts meets) applies both."""
    return bool(params is not None and (params.min_p > 1e-5 or params.logit_bias))


def seeded_depth(fits_budget: bool, max_depth: int) -> int:
    """A seeded sampled request's depth: read from its own context length, never a clock
    (see the module docstring). Example, gamma2 6: 0 while its context fits the retrieval
    budget, 6 at every step after it outgrows it."""
    return 0 if fits_budget else max_depth


class DepthChooser:
    """Per step: `begin` (measurements of the step that just ran), `plan`, one
    `round_done` per middle round, `end`. With `adaptive` false every decoding request
    gets the step's full depth and every level, as a fixed-gamma TriForce (no budget
    rule either: a reference to measure against). Either way at most
    MAX_DRAFTING_REQUESTS requests draft in a step (`cap_drafting`), seeded ones first."""

    def __init__(self, adaptive: bool, max_depth: int, has_draft: bool, stats, share=None,
                 blocks=None, max_drafting: int = MAX_DRAFTING_REQUESTS):
        self.adaptive = adaptive
        # the drafting cap the memory plan reserved for (engine/memory.py `Sizing.drafting`)
        self.max_drafting = max_drafting
        self.share = share  # obj -> rank 0's obj, on every rank (None: one rank)
        self.blocks = blocks  # config.BlockCounts (None: every context outgrows the budget)
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
        self._one_time = 0.0  # the last step's one-time seconds (`end`)
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
            # held to its prediction without the one-time work, which no depth buys
            self.controller.observe_cycle(emitted, start - self._last_start - self._one_time)
            self.achieved_tokens.observe(emitted)
            self.achieved_seconds.observe(start - self._last_start)
            if self._plan is not None and not math.isnan(self._plan.tokens_per_s):
                self.predicted.observe(self._plan.tokens_per_s)
        self._last_start = start
        self._round_seconds = 0.0
        self._plan = None

    def plan(self, req_ids: list[str], max_depth: int, num_committed: list[int] | None = None,
             seeded: list[bool] | None = None,
             plain: list[bool] | None = None) -> tuple[list[int], bool]:
        """(depth per decoding request, whether the small draft runs this step).
        `num_committed` [R]: each request's tokens with exact KV (None: all outgrow the
        budget); `seeded` [R]: it samples from a generator of its own (None: none does);
        `plain` [R]: it must decode plainly (`decodes_plainly`; None: none must)."""
        if not req_ids:  # only prefill chunks: nothing to decide, no probe used up
            return [], False
        seeded = seeded or [False] * len(req_ids)
        plain = plain or [False] * len(req_ids)
        if not self.adaptive:
            depths, use_draft = [0 if p else max_depth for p in plain], self.has_draft
        else:
            depths, use_draft = self._adaptive_plan(req_ids, max_depth, num_committed, seeded,
                                                    plain)
            if self.share is not None:
                depths, use_draft = self.share((depths, use_draft))
        self._warn_if_seeded_over_cap(depths, seeded, self.max_drafting)
        depths = cap_drafting(depths, self.max_drafting, first=seeded)
        self.stats.record_depths(depths)
        return depths, use_draft

    def _adaptive_plan(self, req_ids: list[str], max_depth: int,
                       num_committed: list[int] | None, seeded: list[bool], plain: list[bool]):
        """The controller decides for the unseeded requests whose context outgrew the
        budget; the others have their depth by rule (module docstring)."""
        fits = self._fits_budget(num_committed, len(req_ids))
        limits = [0 if f or s or p else max_depth for f, s, p in zip(fits, seeded, plain)]
        self._plan = self.controller.plan(req_ids, max_depth, limits)
        depths, use_draft = list(self._plan.depths), self._plan.mode == DRAFT
        for r in range(len(req_ids)):
            if plain[r]:
                depths[r] = 0
            elif seeded[r]:
                depths[r] = seeded_depth(fits[r], max_depth)
        if any(s and k for s, k in zip(seeded, depths)):
            use_draft = self.has_draft  # a seeded request drafts with every level, always
        return depths, use_draft

    def _fits_budget(self, num_committed: list[int] | None, num_reqs: int) -> list[bool]:
        if self.blocks is None or num_committed is None:
            return [False] * num_reqs
        return [middle_level_is_the_target(n, self.blocks.block_size, self.blocks.budget_blocks)
                for n in num_committed]

    @staticmethod
    def _warn_if_seeded_over_cap(depths: list[int], seeded: list[bool], cap: int) -> None:
        if sum(1 for k, s in zip(depths, seeded) if s and k > 0) > cap:
            logger.warning_once(
                "TriForce: more than %d seeded requests would draft in one step, the most a "
                "step drafts for: those past the cap decode plainly that step, so their "
                "text depends on the batch (seeds stay reproducible while at most %d seeded "
                "requests decode past the retrieval budget at once).",
                cap, cap)

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
        left out of the drafting overhead the controller weighs depths with, and of the
        cycle a drafting plan's prediction is held to (`observe_cycle`)."""
        self._last_end = time.perf_counter()
        self._one_time = one_time
        if self.adaptive and self._decode_step:
            self.controller.observe_overhead(
                drafting, self._last_end - start - self._round_seconds - one_time)
        self.stats.predicted_tokens_per_s = self.predicted.value or 0.0
        tokens, seconds = self.achieved_tokens.value, self.achieved_seconds.value
        self.stats.achieved_tokens_per_s = tokens / seconds if tokens and seconds else 0.0
