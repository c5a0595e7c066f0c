"""Cost-aware speculation depth: how many tokens each request hands vLLM this step.

TriForce pays for its drafts: middle rounds (the target over its retrieval cache, maybe the
small draft too) and a verification pass over 1 + k tokens instead of 1. Where a middle
round costs nearly a full step (weight-bound: short contexts, small batches, few KV heads)
or verifying k tokens costs several decode steps (compute-bound attention), a fixed k is
slower than plain decoding. This controller measures those costs online and picks, every
step, the depth k_r of each decoding request (0 = a plain decode step for it, no middle
work) and whether the small draft is used, to maximise expected tokens per second.

The model of a step and its exact maximiser live in core/plans.py.

Where the middle level is the target, nobody drafts: a request whose committed context
fits the retrieval cache (`middle_level_is_the_target`) gets depth 0 and no probe, because
each middle round would then be a full pass of the target for one token, plus a
verification over 1 + k tokens: k + 1 passes of the target for at most k + 1 tokens, never
cheaper than plain steps. The engine passes such requests a limit of 0
(`plan(..., limits)`); the controller still counts them in the step, as plain requests.

Lossless: the depths of step s are decided from costs and acceptance counts of steps
before s, before any token of step s is drafted; never from the full-cache verification
of the tokens they cover. Speculative sampling is exact for every fixed k, and a k chosen
independently of that verification is a mixture of exact procedures, hence exact; the
drafted tokens and their distributions do not depend on k (a shorter draft is a prefix of
a longer one).

Estimates stay current: every `probe_interval` steps without drafting the controller
drafts once (at its best positive depth), every `probe_interval` steps without a plain
step it runs one, and every `probe_interval // 4` drafting steps it drafts once at another
depth (the maximum, or half of it), so the plain step, the verification line and the
acceptance profile keep being measured;
with a small draft, the mode not in use is probed the same way. At start-up, while fewer
than `min_evidence` first drafts have been verified or fewer than three verification
(resp. plain) steps timed, the drafting (resp. plain) probe comes every
`max(2, probe_interval // 8)` steps instead:
a few first drafts say little about a request's acceptance, so two unlucky ones must not
settle a server on plain decoding for `probe_interval` steps, nor one slow plain step on
drafting. Where drafting would lose even if every draft were accepted (weight-bound: a
middle round costs about a step), the drafting probe comes only every
`4 * probe_interval` plain steps, doubling after each probe that confirms it up to
`32 * probe_interval` (each probe is a step slower than plain); the interval falls back as
soon as the estimates, re-read every step at the current batch size, let drafting win.
Between those, a drafting plan predicted to lose by a small margin is probed more often: a
probe costs about that margin of one step, so the interval is margin / `probe_budget` steps
(default 1%: a plan 5% short every 5 steps, 32% short or more every `probe_interval`).
Near the break-even point the decision rests on acceptance estimates whose noise exceeds
the margin: a request's estimate from one or two probes can be off by more than the
margin either way, and only more probes tell. A mode
probe counts drafting steps only: while decoding plainly, the drafting probe picks the
mode. A change of plan needs a predicted gain of `hysteresis` (default 3%) over the
current plan.

Predictions are held to what they achieve: the engine reports each timed cycle's tokens
and seconds (`observe_cycle`), and the controller compares them with the rate the plan of
that cycle predicted. `realisation()` is the share of their predicted rate drafting plans
achieved (decayed), taken as 1 from `REALISED_ENOUGH` up (estimation noise, and the
optimism of picking the best of several noisy plans, keep it a little under 1): a drafting
plan is compared with plain decoding at its predicted rate times that, and its probes are
spaced by the shortfall so marked down. Where the model misses a cost (the first draft
token's price, a host busier while drafting), drafting that measures slower than plain
stops, and probes, which keep feeding the comparison, bring it back when it pays again.
Example: drafting predicted 120 tok/s achieves 84 (0.7), plain decoding 100: drafting
counts as 84 tok/s, and plain decoding wins. Plain cycles are not the yardstick: their
prediction comes from the same step's clock, and a line fitted off by a few percent would
mark every drafting plan down with it.
"""

from __future__ import annotations

import math

import numpy as np

import torch

from vllm_triforce.core.estimates import (DecayedLine, DecayedMean, PositionAcceptance,
                                          RecentMedian, RequestAcceptance)
from vllm_triforce.core.plans import (DRAFT, RETRIEVAL, ModeCosts, Plan, StepCosts,
                                      best_in_mode, choose_plan, gains, plain_rate)


# a drafting plan that achieves this share of its predicted tokens/s counts as predicted
REALISED_ENOUGH = 0.9


def middle_level_is_the_target(num_committed, block_size: int, budget_blocks: int):
    """Whether a request of `num_committed` tokens with exact KV fits the retrieval cache
    (an int, or an int array for many requests at once: a bool array):
    its blocks (the partial one included) are at most the budget's, so the selection keeps
    every block (core/blocks.selection_sizes, the dense case) and the middle level attends
    over the whole context: it is the target itself. Drafting then buys at most k + 1 tokens
    for k full passes of the target plus a verification pass: a request this is true of
    decodes plainly.

    Worked example, block_size 32, retrieval_budget 4096 (128 blocks): a 1,500-token prompt
    after 48 new tokens has 1,548 committed tokens = 49 blocks <= 128: plain. At 4,096 tokens
    (128 blocks) still plain; at 4,097 (129 blocks) the middle level leaves a block out, and
    the request may draft from its next step on."""
    num_blocks = -(-num_committed // block_size)
    return num_blocks <= budget_blocks


# ---- the stateful controller: estimates, probes, hysteresis ------------------------------
LAST_PLAN = object()  # `observe_cycle`'s default: hold the cycle to the last plan's rate


class SpeculationController:
    """Feeds measurements into the estimates and turns them into a Plan every step.

    The engine calls, per step: `observe_step` (vLLM's step time and its query tokens),
    `observe_verifications` (per request: drafts verified / accepted), `observe_round` (each
    middle round's time), `observe_overhead` (the rest of the proposer's time), then `plan`.
    """

    def __init__(self, max_depth: int, has_draft: bool, probe_interval: int = 32,
                 hysteresis: float = 0.03, shrink: float = 4.0, prior_alpha: float = 0.6,
                 min_evidence: float = 16.0, probe_budget: float = 0.01):
        self.max_depth = max_depth
        self.modes = (RETRIEVAL, DRAFT) if has_draft else (RETRIEVAL,)
        self.probe_interval = probe_interval
        self.quick_interval = max(2, probe_interval // 8)  # while an estimate is thin
        # drafting steps between probes at another depth: the verification line is a line
        # through the depths the controller drafts at, and a depth it settled on alone
        # leaves the far end to extrapolation: a slope fitted through the points of one
        # depth is mostly noise, and may keep the controller from a deeper, faster depth
        self.depth_probe_interval = max(2, probe_interval // 4)
        self.min_evidence = min_evidence
        self.probe_budget = probe_budget
        self.hysteresis = hysteresis
        self.shrink = shrink
        self.prior_alpha = prior_alpha
        self.step = DecayedLine()        # drafting steps: seconds over query tokens
        self.plain_step = DecayedLine()  # steps without drafts: seconds over requests
        self.idle = RecentMedian()
        self.active = RecentMedian()
        self.rounds = {m: DecayedLine() for m in self.modes}
        self.tokens_per_round = {m: DecayedMean(prior=1.0) for m in self.modes}
        self.batch_acceptance = PositionAcceptance(max_depth)
        self.requests = RequestAcceptance(max_depth)
        self.current: Plan | None = None
        self._num_plans = 0
        self._since_drafting = 0
        self._since_plain = 0
        self._since_mode = dict.fromkeys(self.modes, 0)
        self._since_depth_probe = 0
        self._hopeless_probes = 0  # drafting probes in a row while even alpha = 1 lost
        # achieved / predicted tokens/s of timed drafting cycles
        self.realised = DecayedMean(decay=0.9)
        self._expected: float | None = None  # the last drafting plan's predicted tokens/s

    # ---- measurements
    def observe_step(self, num_reqs: int, num_tokens: int, seconds: float) -> None:
        """vLLM's step over `num_reqs` requests and `num_tokens` query tokens (more tokens
        than requests: it verified drafts)."""
        (self.step if num_tokens > num_reqs else self.plain_step).observe(num_tokens, seconds)

    def observe_verifications(self, req_ids: list[str], num_verified, num_accepted) -> None:
        """Request req_ids[i]'s drafts, num_verified[i] verified of which the first
        num_accepted[i] accepted (distinct requests, [R] lists or arrays)."""
        if len(req_ids):
            self.batch_acceptance.observe(num_verified, num_accepted)
            self.requests.observe(req_ids, num_verified, num_accepted)

    def observe_round(self, mode: str, num_active: int, seconds: float,
                      tokens_per_request: float) -> None:
        self.rounds[mode].observe(num_active, seconds)
        self.tokens_per_round[mode].observe(tokens_per_request, num_active)

    def observe_overhead(self, drafting: bool, seconds: float) -> None:
        (self.active if drafting else self.idle).observe(seconds)

    @property
    def expected(self) -> float | None:
        """The predicted tokens/s the last plan is held to (None: nothing to hold it to)."""
        return self._expected

    def observe_cycle(self, tokens: int, seconds: float, expected=LAST_PLAN) -> None:
        """A plan's cycle, timed: `tokens` committed in `seconds` (module docstring:
        predictions held to what they achieve), held to `expected`: that plan's `expected`
        (LAST_PLAN: the last plan's; a caller that planned again since passes the earlier
        one's). Probes at depths no decision chose and steps without a decision are not
        held to anything."""
        expected = self._expected if expected is LAST_PLAN else expected
        if expected is not None and seconds > 0:
            self.realised.observe(tokens / seconds / expected)

    def realisation(self, min_cycles: int = 4) -> float:
        """Achieved / predicted tokens/s of drafting cycles; 1 from REALISED_ENOUGH up and
        until `min_cycles` were timed."""
        if self.realised.n < min_cycles or self.realised.value >= REALISED_ENOUGH:
            return 1.0
        return self.realised.value

    def retain(self, req_ids) -> None:
        self.requests.retain(req_ids)

    # ---- the decision
    def costs(self, num_reqs: int) -> StepCosts | None:
        """Current estimates for a batch of `num_reqs`, or None while no step was measured."""
        step = self.step.coefficients() or self.plain_step.coefficients()
        modes = {}
        for m in self.modes:
            c = self.rounds[m].coefficients()
            if c is not None:
                modes[m] = ModeCosts(c[0], c[1], self.tokens_per_round[m].value)
        if step is None:
            return None
        return StepCosts(step[0], step[1], self.idle.value, self.active.value, modes,
                         self.plain_step.predict(num_reqs))

    def alphas(self, req_ids: list[str], max_depth: int,
               limits: np.ndarray | list[int] | None = None) -> torch.Tensor:
        """[R, max_depth] per-request acceptance profile, shrunk towards the batch's; zero
        past each request's `limits` entry (a draft it may not make gains nothing)."""
        prior = self.batch_acceptance.alphas(np.full(self.max_depth, self.prior_alpha), 1.0)
        alphas = torch.from_numpy(self.requests.alphas(req_ids, prior, self.shrink))
        return alphas[:, :max_depth] * _allowed(limits, len(req_ids), max_depth)

    def plan(self, req_ids: list[str], max_depth: int,
             limits: np.ndarray | list[int] | None = None) -> Plan:
        """Depths for the decoding requests `req_ids` (max_depth: this step's upper bound).
        `limits` [R] (a list or an int array): the most each request may draft (default
        max_depth). Decisions and probes stay within them, and a step where every limit is 0
        is plain without a probe spent: the requests still count in the step's cost model,
        as plain ones."""
        max_depth = min(max_depth, self.max_depth)
        limits = (np.full(len(req_ids), max_depth, dtype=np.int64) if limits is None
                  else np.minimum(np.asarray(limits, dtype=np.int64), max_depth))
        self._expected = None
        if not limits.any():
            plan = Plan((0,) * len(req_ids), None, math.nan)
        else:
            plan = (self._probe(req_ids, max_depth, limits)
                    or self._decide(req_ids, max_depth, limits))
        plan = _within(plan, limits)
        self._count(plan)
        return plan

    def _decide(self, req_ids: list[str], max_depth: int, limits: np.ndarray) -> Plan:
        """The best plan at realised rates (`_realised`), unless the settled one is within
        `hysteresis` of it."""
        alphas, costs = self.alphas(req_ids, max_depth, limits), self.costs(len(req_ids))
        best = self._realised(choose_plan(alphas, costs, max_depth), costs)
        settled = self.current
        if settled is not None and (settled.mode, settled.max_depth) != (best.mode,
                                                                          best.max_depth):
            keep = self._realised(choose_plan(
                alphas, costs, max_depth, only=(settled.mode, min(settled.max_depth, max_depth))),
                costs)
            if self._rate(best) <= self._rate(keep) * (1 + self.hysteresis):
                best = keep
        self.current = best
        self._expected = best.tokens_per_s if best.max_depth else None
        return best

    def _rate(self, plan: Plan) -> float:
        """A plan's predicted tokens/s as realised: a drafting plan's marked down."""
        return plan.tokens_per_s * (self.realisation() if plan.max_depth else 1.0)

    def _realised(self, plan: Plan, costs: StepCosts) -> Plan:
        """`plan`, or plain decoding where that beats the drafting plan's realised rate."""
        plain = plain_rate(len(plan.depths), costs)
        if plan.max_depth and self._rate(plan) < plain:
            return Plan((0,) * len(plan.depths), None, plain)
        return plan

    def _probe(self, req_ids: list[str], max_depth: int, limits: np.ndarray) -> Plan | None:
        """A measuring step when an estimate is missing or stale, else None. Start-up: plain
        steps until one is timed (the engine times no step after a prefill or a change of
        requests), then one step at full depth in every mode, which is then timed too: it
        gives the verification line its far end (probes at the best depth alone leave the
        slope at its prior, so weight-bound drafting never looks hopeless and is probed
        again and again), and an untimed probe teaches nothing and would be repeated, each
        time a step slower than plain."""
        if max_depth < 1:
            return None
        num_reqs = len(req_ids)
        if not self.plain_step.seen:  # until a step is timed: plain (see the docstring)
            return Plan((0,) * num_reqs, None, math.nan)
        costs = self.costs(num_reqs)
        for m in self.modes:
            if not self.rounds[m].seen or self._since_mode[m] >= 2 * self.probe_interval:
                return Plan((max_depth,) * num_reqs, m, math.nan)
        plain_interval = self.quick_interval if self.plain_step.n < 3 else self.probe_interval
        if not self.idle.n or self._since_plain >= plain_interval:
            return Plan((0,) * num_reqs, None, math.nan)
        settled = self.current
        if (settled is not None and settled.max_depth > 0
                and self._since_depth_probe >= self.depth_probe_interval):
            other = max_depth if settled.max_depth < max_depth else max(1, max_depth // 2)
            self._since_depth_probe = 0
            return Plan((other,) * num_reqs, settled.mode, math.nan)
        best = self._best_drafting(req_ids, costs, max_depth, limits)
        interval, hopeless = self._drafting_probe_interval(costs, limits, max_depth, best)
        self._hopeless_probes = self._hopeless_probes if hopeless else 0
        if self._since_drafting >= max(self.quick_interval, interval):
            self._hopeless_probes += hopeless
            self._expected = best and best.tokens_per_s
            return best and Plan(best.depths, best.mode, math.nan)
        return None

    def _best_drafting(self, req_ids: list[str], costs: StepCosts, max_depth: int,
                       limits: np.ndarray | None = None):
        """The best plan that drafts (any mode) within `limits`, or None."""
        alphas = self.alphas(req_ids, max_depth, limits)
        plans = [best_in_mode(gains(alphas.double()), costs, m, costs.modes[m], max_depth)
                 for m in costs.modes]
        return max((p for p in plans if p is not None), key=lambda p: p.tokens_per_s,
                   default=None)

    def _drafting_probe_interval(self, costs: StepCosts, limits: np.ndarray, max_depth: int,
                                 best: Plan | None) -> tuple[int, bool]:
        """(plain steps between drafting probes, whether drafting is hopeless): `quick_interval`
        while fewer than three verification steps are timed (a line through one or two
        start-up steps is too uncertain to keep a request plain for `probe_interval` steps);
        when drafting would lose even if every draft were accepted (only its costs
        need refreshing, and each probe is a step slower than plain) 4x `probe_interval`,
        doubled per probe in a row that found it so, at most 32x; quick again while the
        acceptance evidence is thin and could change the decision; in between, the best
        drafting plan `best`'s predicted shortfall / `probe_budget` (see the docstring)."""
        if self.step.n < 3:
            return self.quick_interval, False
        num_reqs = len(limits)
        perfect = _allowed(limits, num_reqs, max_depth)  # every allowed draft accepted
        if choose_plan(perfect, costs, max_depth).max_depth == 0:
            return (4 << min(self._hopeless_probes, 3)) * self.probe_interval, True
        if self.batch_acceptance.tried[0] < self.min_evidence:
            return self.quick_interval, False
        if best is None or self.probe_budget <= 0:
            return self.probe_interval, False
        shortfall = 1.0 - self._rate(best) / plain_rate(num_reqs, costs)
        steps = math.ceil(max(shortfall, 0.0) / self.probe_budget)
        return min(max(steps, self.quick_interval), self.probe_interval), False

    def _count(self, plan: Plan) -> None:
        self._num_plans += 1
        drafting = plan.max_depth > 0
        self._since_drafting = 0 if drafting else self._since_drafting + 1
        self._since_plain = self._since_plain + 1 if drafting else 0
        self._since_depth_probe += drafting
        for m in self.modes:
            self._since_mode[m] = 0 if plan.mode == m else self._since_mode[m] + drafting


def _allowed(limits: np.ndarray | list[int] | None, num_reqs: int,
             max_depth: int) -> torch.Tensor:
    """[R, max_depth] float64: 1 where draft j (0-based) is within request r's limit."""
    if limits is None:
        return torch.ones(num_reqs, max_depth, dtype=torch.float64)
    positions = torch.arange(max_depth)
    return (positions < torch.tensor(limits, dtype=torch.long)[:, None]).double()


def _within(plan: Plan, limits: np.ndarray) -> Plan:
    """`plan` with every depth cut to its request's limit [R] (probes ask for one depth for
    every request)."""
    if not plan.max_depth:  # a plain plan (most plans): nothing to cut
        return plan
    depths = tuple(np.minimum(plan.depths, limits).tolist())
    if depths == plan.depths:
        return plan
    return Plan(depths, plan.mode if max(depths, default=0) else None, plan.tokens_per_s)
