"""The depth decision as a pure function: the model of one step's tokens and seconds, and
the plan (a depth per request, a middle mode) that maximises their ratio. The stateful
controller (core/controller.py) feeds it estimates.

Model of one step (B decoding requests, depths k_r <= K = max_r k_r):

  tokens  = sum_r (1 + A_r(k_r)),      A_r(k) = sum_{i=1..k} prod_{j=1..i} alpha_{r,j}
  seconds = T_step(B + sum_r k_r) + overhead + rounds(K) * round_fixed
            + sum_r rounds(k_r) * round_per_request

  alpha_{r,j}  chance the full cache accepts draft j given drafts < j were accepted
               (decayed counts per request, shrunk towards the batch-wide profile);
  T_step(n)    vLLM's own step verifying n query tokens: step_fixed + step_per_token * n,
               fitted on drafting steps only; a step with no drafts has its own cost
               (plain_step), because the first draft token is not marginal: on a CPU,
               vLLM's attention leaves its decode path for a multi-token one, which costs
               a step of its own before any per-token cost, and a line through both kinds
               of steps would price depth wrongly;
  rounds(k)    middle rounds to produce k tokens: k with the retrieval level alone (one
               token per round), k / tokens_per_round with the small draft.
  Every K = 0 step has `seconds = plain_step + idle_overhead`.

Worked example (one request, alpha = 0.8 at every position, step 10 ms + 1 ms per query
token, retrieval rounds 4 ms, no overhead): k = 0 gives 1 token in 11 ms (91 tok/s);
k = 2 gives 1 + 0.8 + 0.64 = 2.44 tokens in 13 + 8 = 21 ms (116 tok/s); k = 4 gives 3.36
tokens in 15 + 16 = 31 ms (108 tok/s): the controller picks k = 2. With rounds of 9 ms,
k = 2 takes 31 ms (79 tok/s) and k = 0 wins.

The maximum of tokens / seconds over all (K, mode, k_r) is found exactly by Dinkelbach's
iteration: for a rate lambda, maximise tokens - lambda * seconds (separable per request
once K and the mode are fixed), set lambda to the rate of the maximiser, repeat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

RETRIEVAL = "retrieval"  # middle rounds: the target over its retrieval cache, one token each
DRAFT = "draft"          # middle rounds: the small draft proposes, the retrieval level verifies


@dataclass(frozen=True)
class ModeCosts:
    """Middle rounds of one mode: round cost = round_fixed + round_per_request * active."""
    round_fixed: float
    round_per_request: float
    tokens_per_round: float = 1.0  # middle tokens one request gains per round


@dataclass(frozen=True)
class StepCosts:
    """Seconds. `modes` maps RETRIEVAL / DRAFT to their round costs (absent: unusable)."""
    step_fixed: float         # a verification step: step_fixed + step_per_token * tokens
    step_per_token: float
    idle_overhead: float      # proposer time of a step with no drafting
    active_overhead: float    # proposer time of a drafting step besides its rounds
    modes: dict = field(default_factory=dict)
    plain_step: float | None = None  # vLLM's step without drafts; None: the line at B


@dataclass(frozen=True)
class Plan:
    depths: tuple[int, ...]   # [num decoding requests] tokens handed to vLLM, 0 allowed
    mode: str | None          # RETRIEVAL or DRAFT; None when every depth is 0
    tokens_per_s: float       # predicted

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)


def gains(alphas: torch.Tensor) -> torch.Tensor:
    """[R, k_max] per-position acceptance -> [R, k_max + 1] A_r(k): expected accepted drafts."""
    run = torch.cumprod(alphas, dim=1)
    return torch.cat([torch.zeros(alphas.shape[0], 1, dtype=run.dtype), run.cumsum(1)], 1)


def plain_rate(num_reqs: int, costs: StepCosts) -> float:
    step = costs.plain_step
    if step is None:
        step = costs.step_fixed + costs.step_per_token * num_reqs
    return num_reqs / (step + costs.idle_overhead)


def choose_plan(alphas: torch.Tensor, costs: StepCosts, max_depth: int,
                only: tuple[str | None, int] | None = None) -> Plan:
    """The plan maximising predicted tokens/s. alphas [R, >= max_depth]; `only` = (mode,
    K) restricts the search to one mode and maximum depth (used for hysteresis)."""
    num_reqs = alphas.shape[0]
    best = Plan((0,) * num_reqs, None, plain_rate(num_reqs, costs))
    if only is not None and only[0] is None:
        return best
    gain = gains(alphas[:, :max_depth].double())  # [R, max_depth + 1]
    for mode, mc in costs.modes.items():
        if only is not None and mode != only[0]:
            continue
        plan = best_in_mode(gain, costs, mode, mc, max_depth if only is None else only[1])
        if plan is not None and plan.tokens_per_s > best.tokens_per_s:
            best = plan
    return best


def best_in_mode(gain, costs: StepCosts, mode: str, mc: ModeCosts, max_depth: int):
    """Dinkelbach over (K, k_r) for one mode; None if no depth > 0 is possible."""
    if max_depth < 1:
        return None
    num_reqs = gain.shape[0]
    ks = torch.arange(max_depth + 1, dtype=torch.float64)
    rounds = ks / mc.tokens_per_round                            # [K + 1]
    per_req = costs.step_per_token * ks + mc.round_per_request * rounds  # [K + 1] c(k)
    base = (costs.step_fixed + costs.step_per_token * num_reqs + costs.active_overhead
            + mc.round_fixed * rounds)                           # [K + 1] C0(K)
    rate = plain_rate(num_reqs, costs)
    plan = None
    for _ in range(20):
        value = gain[:, :max_depth + 1] - rate * per_req         # [R, K + 1]
        best_val, best_k = _prefix_argmax(value)                 # best k_r <= K, per K
        total = num_reqs + best_val.sum(0) - rate * base         # [K + 1]
        total[0] = -math.inf                                     # K = 0 is the plain plan
        K = int(total.argmax())
        depths = best_k[:, K]
        if int(depths.max()) == 0:
            return plan
        K = int(depths.max())
        tokens = num_reqs + float(gain.gather(1, depths[:, None]).sum())
        seconds = float(base[K] + per_req[depths].sum())
        new = Plan(tuple(depths.tolist()), mode, tokens / seconds)
        if plan is not None and new.tokens_per_s <= plan.tokens_per_s * (1 + 1e-9):
            return plan if plan.tokens_per_s >= new.tokens_per_s else new
        plan, rate = new, new.tokens_per_s
    return plan


def _prefix_argmax(value: torch.Tensor):
    """value [R, K + 1] -> (max over k <= K, its argmax), each [R, K + 1]; ties: smaller k."""
    ks = torch.arange(value.shape[1], dtype=value.dtype)
    _, best_k = torch.cummax(value - 1e-12 * ks, dim=1)  # the tilt breaks ties towards small k
    return value.gather(1, best_k), best_k
