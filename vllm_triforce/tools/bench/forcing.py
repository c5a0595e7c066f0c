"""What the distribution checks force on a TriForce engine, for the tests
(tests/test_triforce_sampling.py) and the GPU check's sampled jobs (bench/gpu_job.py):

* `schedule_depths`: the depth controller plans given depths in turn, so that sampled
  output is checked with depths that vary within and across steps, 0 included;
* `hand_off_wrong` (V1) and `keep_wrong_logits` (Model Runner V2): the negative control.
  The verifier is handed the middle level's distributions sharpened to a lower temperature,
  while the drafts stay drawn from the real ones. Rejection sampling accepts a draft x with
  min(1, p(x) / q(x)) and recovers from max(p - q, 0) for the q it is handed, which is
  exact only when q is the distribution x was drawn from; a distribution check that lets
  this through cannot tell a wrong hand-off from a right one. (The same change applied to
  the drawing too would stay exact: another draft distribution, verified against itself.)
"""

from __future__ import annotations

import itertools
import math


def schedule_depths(controller, depths: list[int]) -> None:
    """`controller` (core/controller.SpeculationController) plans `depths` in turn instead
    of deciding. Request i of the n-th plan from now gets depths[(n + i) % len(depths)],
    cut to the step's bound and to its limit as the controller's own plans are, in the
    last mode (the small draft's, where there is one), so depths vary within and across
    steps while the engine's rules (budget, seeds, plain sampling, the drafting cap) still
    apply. A decision of the test or bench, never of a served engine."""
    from vllm_triforce.core.plans import Plan

    plans = itertools.count()

    def scheduled(req_ids, max_depth, limits=None):
        n, bound = next(plans), min(max_depth, controller.max_depth)
        limits = [bound] * len(req_ids) if limits is None else limits
        chosen = tuple(min(depths[(n + i) % len(depths)], bound, limit)
                       for i, limit in enumerate(limits))
        return Plan(chosen, controller.modes[-1] if max(chosen, default=0) else None, math.nan)

    controller.plan = scheduled


def hand_off_wrong(hand_off, temperature: float):
    """engine/drafting's `hand_off` (V1: draft probabilities by batch row) handing vLLM
    the middle level's distributions sharpened to `temperature`."""

    def handing_off_wrong_probs(*args, **kwargs):
        drafts, probs, req_ids = hand_off(*args, **kwargs)
        if probs is not None:  # [D, max depth, V], zero rows where a request drafts less
            sharpened = probs.pow(1.0 / temperature)
            probs.copy_(sharpened / sharpened.sum(-1, keepdim=True).clamp_min(1e-30))
        return drafts, probs, req_ids

    return handing_off_wrong_probs


def keep_wrong_logits(keep_logits, temperature: float):
    """engine/middle's `keep_logits` (Model Runner V2: pre-temperature logits by slot and
    step) keeping the logits divided by `temperature`: the verifier's softmax(logits / T)
    becomes the distribution sharpened to `temperature`, as `hand_off_wrong` hands V1."""

    def keeping_wrong_logits(buffer, logits, *args, **kwargs):
        return keep_logits(buffer, logits / temperature, *args, **kwargs)

    return keeping_wrong_logits


def force_wrong_hand_off(temperature: float) -> None:
    """Both bindings' hand-off made wrong in this process (`hand_off_wrong`,
    `keep_wrong_logits`): for a negative-control engine in a process of its own."""
    from vllm_triforce.engine import drafting, middle

    drafting.hand_off = hand_off_wrong(drafting.hand_off, temperature)
    middle.keep_logits = keep_wrong_logits(middle.keep_logits, temperature)
