"""The engine side of core/controller.py: clocks and counts in, per-request depths out.

Timeline of the proposer inside vLLM's sync loop (vLLM 0.32 V1 runner, async scheduling
off), step s:

    ... propose(s-1) returns | vLLM step s: schedule, full-cache pass over 1 + k tokens per
    request, rejection sampling | propose(s) starts: commit, plan, middle rounds | returns

so vLLM's own cost of a step is the wall time from the end of one `propose` to the start
of the next, and a whole cycle (what tokens per second divide by) runs from one start to
the next. Only steps whose every request ran a decode or verification, after a step that
did too and had the same requests, are timed: a prefill chunk is not what a draft depth
buys; the first decode after one still pays for the prefill's output, a cost no depth
changes; and a request joining means the engine may have sat idle in between (between two
`generate` calls, or a server waiting for work). Likewise the proposer's own time counts
as per-step overhead only on decode steps: on a prefill step it folds the prompt's keys
into the block summaries, a cost of the prompt's length that no later step pays again.

Each step is one `DepthStep`, made by `DepthChooser.begin` from what the step before
measured; only it plans the step, hears its middle rounds and ends it. What the next step's
timing needs of it is handed on when it ends, as one record (`_Ended`).

Fixed depth (`DepthChooser.fix`, the proposer's `set_fixed_depth`; `adaptive: false` sets
num_speculative_tokens from the start): every decoding request gets that depth, at most the
step's bound, and every level, with no clock and no budget rule (fixed-gamma TriForce, the
reference the controller is measured against); the controller is neither asked nor told
of middle rounds meanwhile.

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
  requests draft in one step than the cap (max_num_seqs, unless the memory plan's share
  of a small cache holds fewer: `Sizing.drafting`; past it, which ones draft depends on
  the batch, logged once), and with
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
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from vllm.logger import init_logger

from vllm_triforce.core.controller import SpeculationController, middle_level_is_the_target
from vllm_triforce.core.plans import DRAFT, RETRIEVAL, Plan
from vllm_triforce.core.estimates import DecayedMean

logger = init_logger("vllm.triforce")


def cap_drafting(depths: list[int], cap: int,
                 first: list[bool] | None = None) -> list[int]:
    """At most `cap` positive depths: the drafting requests marked in `first` (seeded
    ones, whose text must not depend on the others), then the rest, each in batch order
    (vLLM's, oldest first), keep theirs; the others run a plain step.
    Examples: cap_drafting([2, 0, 3, 1], 2) -> [2, 0, 3, 0];
    cap_drafting([2, 0, 3, 1], 2, first=[False, False, False, True]) -> [2, 0, 0, 1]."""
    if len(depths) - depths.count(0) <= cap:  # the usual case: nothing to cut
        return list(depths)
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


class Verified(NamedTuple):
    """What vLLM's pass verified: request req_ids[i] verified num_verified[i] drafts and
    accepted the first num_accepted[i] ([n] int64 arrays; distinct requests). Arrays, not
    a tuple per request, so that no step walks its requests one by one in Python."""
    req_ids: list[str] | tuple
    num_verified: np.ndarray
    num_accepted: np.ndarray

    @staticmethod
    def none() -> "Verified":
        """A pass that verified no drafts (a plain step's; one record, never changed)."""
        return _NONE_VERIFIED


_NONE_VERIFIED = Verified((), np.zeros(0, np.int64), np.zeros(0, np.int64))


class _Ahead(NamedTuple):
    """A plan made during vLLM's pass, before its step begins (`DepthChooser.plan_ahead`),
    for the step that then takes it."""
    req_ids: list[str]            # the decoding requests it is for
    depths: list[int]             # each one's depth
    use_draft: bool               # whether the small draft runs
    controller_plan: Plan | None  # the controller's, when it decided


@dataclass(frozen=True)
class _Ended:
    """What the next step's timing reads of the step before it (`DepthStep.end`)."""
    start: float
    end: float
    one_time: float          # seconds of one-time work in it (`DepthStep.end`)
    req_ids: frozenset       # the requests of vLLM's pass
    pure_decode: bool
    plan: Plan | None        # the controller's, when the controller decided it
    expected: float | None   # the rate the controller holds that plan's cycle to


class DepthChooser:
    """Chooses each step's depths (module docstring): `begin` makes the step's `DepthStep`,
    which plans it (`plan`, through this chooser's), hears its middle rounds and ends it.
    `fixed_depth`: the configured fixed depth (`adaptive: false`: num_speculative_tokens;
    None: the controller decides), which `fix` overrides. Either way at most
    `max_drafting` requests draft in a step (`cap_drafting`), seeded ones first (None:
    every decoding request may)."""

    def __init__(self, max_depth: int, has_draft: bool, stats, fixed_depth: int | None = None,
                 share=None, blocks=None, max_drafting: int | None = None):
        self.configured_depth = self.fixed_depth = fixed_depth
        # the drafting cap the memory plan reserved for (engine/memory.py `Sizing.drafting`:
        # max_num_seqs, or what the cache's share holds: `scaled_limit`)
        self.max_drafting = max_drafting
        self.share = share  # obj -> rank 0's obj, on every rank (None: one rank)
        self.blocks = blocks  # config.BlockCounts (None: every context outgrows the budget)
        self.has_draft = has_draft
        self.controller = SpeculationController(max_depth, has_draft)
        self.stats = stats
        self.achieved_tokens = DecayedMean(decay=0.9)  # tokens per cycle ...
        self.achieved_seconds = DecayedMean(decay=0.9)  # ... and its seconds
        self.predicted = DecayedMean(decay=0.9)
        self._last: _Ended | None = None  # the step that ended last
        # a plan made during vLLM's pass, before its step begins (`plan_ahead`), which
        # that step's `DepthStep` takes
        self._ahead: _Ahead | None = None

    def fix(self, depth: int | None) -> None:
        """From the next step on, every decoding request drafts `depth` tokens (module
        docstring); None: back to the configured behaviour."""
        self.fixed_depth = self.configured_depth if depth is None else depth

    def begin(self, start: float, req_ids: list[str], num_tokens: int, emitted: int,
              pure_decode: bool, verified: Verified,
              live_req_ids) -> "DepthStep":
        """The step that starts at `start`, after vLLM's pass over `req_ids` (`num_tokens`
        query tokens, `emitted` of them committed; `verified`: the drafts it verified;
        `pure_decode`: no prefill chunk in it). Feeds the controller what that pass
        measured."""
        self.controller.retain(live_req_ids)
        self.controller.observe_verifications(*verified)
        last = self._last
        if (last is not None and pure_decode and last.pure_decode
                and set(req_ids) <= last.req_ids):
            self._observe_cycle(last, start, len(req_ids), num_tokens, emitted)
        return DepthStep(self, start, req_ids, pure_decode)

    def _observe_cycle(self, last: _Ended, start: float, num_reqs: int, num_tokens: int,
                       emitted: int) -> None:
        """A timed step: vLLM's share of it, and the cycle since `last` began."""
        self.controller.observe_step(num_reqs, num_tokens, start - last.end)
        if last.plan is not None:
            # held to its prediction without the one-time work, which no depth buys
            self.controller.observe_cycle(emitted, start - last.start - last.one_time,
                                          last.expected)
            if not math.isnan(last.plan.tokens_per_s):
                self.predicted.observe(last.plan.tokens_per_s)
        self.achieved_tokens.observe(emitted)
        self.achieved_seconds.observe(start - last.start)

    def plan(self, step: "DepthStep", req_ids: list[str], max_depth: int,
             num_committed: list[int] | None = None, seeded: list[bool] | None = None,
             plain: list[bool] | None = None) -> tuple[list[int], bool]:
        """`step`'s plan (`DepthStep.plan`): (depth per decoding request, whether the small
        draft runs). `max_depth`: the step's bound from vLLM; `num_committed` [R]: each
        request's tokens with exact KV (None: all outgrow the budget); `seeded` [R]: it
        samples from a generator of its own (None: none does); `plain` [R]: it must decode
        plainly (`decodes_plainly`; None: none must). A plan made ahead for these requests
        (`plan_ahead`) is taken instead, cut to `max_depth`."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.req_ids == req_ids:
            depths = [min(k, max_depth) for k in ahead.depths]
            use_draft, step.controller_plan = ahead.use_draft, ahead.controller_plan
        else:
            depths, use_draft, step.controller_plan = self._plan(req_ids, max_depth,
                                                                 num_committed, seeded, plain)
        self.stats.record_depths(depths)
        return depths, use_draft

    def plan_ahead(self, req_ids: list[str], max_depth: int, num_committed: list[int],
                   plain: list[bool]) -> bool:
        """The plan of the step whose pass vLLM is running, made before the step begins,
        from the host's facts (engine/plain_steps.py `PlainSteps.plan_ahead`): the decoding
        requests `req_ids`, none seeded, with the controller deciding and one TP rank
        (no `share`); kept for the step's `DepthStep` (`plan` for a step that drafts,
        `take_plan_ahead` for one that does not). Returns whether it drafts. The
        controller plans before it hears how long the cycle that ends at this step's start
        took (`begin`): its estimates are one step older than `plan`'s."""
        self._ahead = _Ahead(list(req_ids), *self._plan(req_ids, max_depth, num_committed,
                                                        None, plain))
        return any(self._ahead.depths)

    @property
    def planned_ahead(self) -> bool:
        return self._ahead is not None

    def forget_plan_ahead(self) -> None:
        """A plan made ahead that no step took (vLLM's next pass is another step's)."""
        self._ahead = None

    def _plan(self, req_ids: list[str], max_depth: int, num_committed: list[int] | None,
              seeded: list[bool] | None, plain: list[bool] | None):
        """(depths, whether the small draft runs, the controller's Plan or None): `plan`."""
        if not req_ids:  # only prefill chunks: nothing to decide, no probe used up
            return [], False, None
        controller_plan = None
        seeded = seeded or [False] * len(req_ids)
        plain = plain or [False] * len(req_ids)
        if self.fixed_depth is not None:
            depth = min(self.fixed_depth, max_depth)
            depths = ([0 if p else depth for p in plain] if any(plain)
                      else [depth] * len(req_ids))
            use_draft = self.has_draft
        else:
            fits = self._fits_budget(num_committed, len(req_ids))
            # the controller decides for the unseeded requests whose context outgrew the
            # budget and that may draft; the others have their depth by rule
            ruled = fits
            for flags in (seeded, plain):
                if any(flags):  # mostly neither is: no array made
                    ruled = ruled | np.asarray(flags, dtype=bool)
            controller_plan = self.controller.plan(req_ids, max_depth,
                                                   np.where(ruled, 0, max_depth))
            depths, use_draft = self._by_rule(controller_plan, max_depth, fits, seeded, plain)
            if self.share is not None:
                depths, use_draft = self.share((depths, use_draft))
        if self.max_drafting is not None:
            self._warn_if_seeded_over_cap(depths, seeded, self.max_drafting)
            depths = cap_drafting(depths, self.max_drafting, first=seeded)
        return depths, use_draft, controller_plan

    def _by_rule(self, plan: Plan, max_depth: int, fits: np.ndarray, seeded: list[bool],
                 plain: list[bool]) -> tuple[list[int], bool]:
        """The controller's `plan`, with the depths the rules give (module docstring); `fits`
        [R] bool: the budget holds its context."""
        use_draft = plan.mode == DRAFT
        if not (any(seeded) or any(plain)):  # the usual case: the controller's depths
            return list(plan.depths), use_draft
        seeded, plain = np.asarray(seeded, dtype=bool), np.asarray(plain, dtype=bool)
        by_seed = np.where(fits, seeded_depth(True, max_depth), seeded_depth(False, max_depth))
        depths = np.where(plain, 0, np.where(seeded, by_seed, plan.depths))
        if (seeded & (depths > 0)).any():
            use_draft = self.has_draft  # a seeded request drafts with every level, always
        return depths.tolist(), use_draft

    def _fits_budget(self, num_committed: list[int] | None, num_reqs: int) -> np.ndarray:
        """[R] bool: each request's context fits the retrieval budget (none without the
        counts)."""
        if self.blocks is None or num_committed is None:
            return np.zeros(num_reqs, dtype=bool)
        return middle_level_is_the_target(np.asarray(num_committed, dtype=np.int64),
                                          self.blocks.block_size, self.blocks.budget_blocks)

    @staticmethod
    def _warn_if_seeded_over_cap(depths: list[int], seeded: list[bool], cap: int) -> None:
        if any(seeded) and sum(1 for k, s in zip(depths, seeded) if s and k > 0) > cap:
            logger.warning_once(
                "TriForce: more than %d seeded requests would draft in one step, the most a "
                "step drafts for: those past the cap decode plainly that step, so their "
                "text depends on the batch (seeds stay reproducible while at most %d seeded "
                "requests decode past the retrieval budget at once).",
                cap, cap)


class DepthStep:
    """One step's depths, made by `DepthChooser.begin`: `plan` once, `round_done` after
    each middle round, `end` once. `controller_plan`: the controller's Plan when it
    decided the step (None with a fixed depth, or with no decoding request)."""

    def __init__(self, chooser: DepthChooser, start: float, req_ids: list[str],
                 pure_decode: bool):
        self.chooser = chooser
        self.start = start
        self.req_ids = frozenset(req_ids)
        self.pure_decode = pure_decode  # its overhead is the controller's to weigh
        self.controller_plan: Plan | None = None
        self.round_seconds = 0.0

    def take_plan_ahead(self, req_ids: list[str]) -> None:
        """A step that drafts nothing by the plan made ahead for its decoding requests
        `req_ids` (`DepthChooser.plan_ahead`), run as a plain step (engine/plain_steps.py):
        the plan becomes this step's, so the step is timed and held to it like any the
        controller decided."""
        chooser = self.chooser
        ahead, chooser._ahead = chooser._ahead, None
        if ahead is not None and ahead.req_ids == req_ids:
            self.controller_plan = ahead.controller_plan

    def plan(self, req_ids: list[str], max_depth: int, num_committed: list[int] | None = None,
             seeded: list[bool] | None = None,
             plain: list[bool] | None = None) -> tuple[list[int], bool]:
        """(depth per decoding request `req_ids`, whether the small draft runs this step):
        `DepthChooser.plan`."""
        return self.chooser.plan(self, req_ids, max_depth, num_committed, seeded, plain)

    def round_done(self, use_draft: bool, num_active: int, seconds: float,
                   tokens_per_request: float) -> None:
        self.round_seconds += seconds
        if self.controller_plan is not None:
            self.chooser.controller.observe_round(DRAFT if use_draft else RETRIEVAL,
                                                  num_active, seconds, tokens_per_request)

    def end(self, drafting: bool, one_time: float = 0.0) -> None:
        """`one_time`: seconds of this step's work that a request pays once, not per
        drafting step (the lazy summaries of the blocks it completed since it last
        selected: after a plain stretch, all of that stretch's at once):
        left out of the drafting overhead the controller weighs depths with, and of the
        cycle a drafting plan's prediction is held to (`observe_cycle`)."""
        chooser, end = self.chooser, time.perf_counter()
        chooser._last = _Ended(self.start, end, one_time, self.req_ids, self.pure_decode,
                               self.controller_plan, chooser.controller.expected)
        if self.controller_plan is not None and self.pure_decode:
            chooser.controller.observe_overhead(
                drafting, end - self.start - self.round_seconds - one_time)
        stats = chooser.stats
        stats.predicted_tokens_per_s = chooser.predicted.value or 0.0
        tokens, seconds = chooser.achieved_tokens.value, chooser.achieved_seconds.value
        stats.achieved_tokens_per_s = tokens / seconds if tokens and seconds else 0.0
