"""A sampled round's vocabulary work as compiled functions (`compiled_sampling`, config.py).

Where a batch samples (some request has temperature > 0), every draft step and every
middle round turns logits into distributions and draws from them: the temperature, top-k
and top-p transform and softmax (core/verify.py `sampling_probs`), then a draw by inverse
CDF (`sample_tokens`) or, for the middle level's check of the small draft's proposals,
the acceptance tests, the residual and the final draw (`verify`). Eagerly that is some
150 host operations a three-level round (benchmarks/explore/host_overhead.py
`--temperature 0.8 --ops`), each a kernel launch on a GPU. Here each of those places is
one compiled function (core/compiled.py), called where the eager code runs:

- `draw`: a draft step's, or a two-level middle round's, distributions and tokens from
  its logits and the batch rows of its requests;
- `verify`: a middle round's distributions per request from the pass's logits, then
  `verify_drawn` of the small draft's proposals; it returns them for the hand-off.

Each is compiled twice, temperature only and with top-k and top-p (a batch where nobody
filters sorts nothing), so four compilations at start-up (about 10 s on a CPU). The
uniforms are drawn before the call, eagerly, exactly as the eager path draws them
(`draw_uniforms`: a seeded request's from its own generator), so a seeded request's row
reads the same uniforms whichever path runs; the compiled arithmetic may differ from
eager torch's in the last bits of a probability, and the draws and the distributions
handed to the next level are the compiled ones, so sampling stays exact. An all-greedy
batch never comes here (its rounds read argmaxes only).

The functions below are the eager twin: uncompiled, they give the eager path's values
bit for bit on a CPU (tests/core/test_core_compiled_sampling.py); after a compiled call
fails (it would have compiled again), `CompiledSampling` runs them eagerly, with a
warning, for the rest of the engine's life.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor
from torch._dynamo.decorators import mark_static, mark_unbacked

from vllm_triforce.core.compiled import CompiledFunction, dense, first_line, inference
from vllm_triforce.core.verify import (GREEDY_TEMPERATURE, _rows_probs, sample_drawn,
                                       verify_drawn)

logger = logging.getLogger(__name__)


def draw(logits: Tensor, rows: Tensor, temperature: Tensor,
         uniform: Tensor) -> tuple[Tensor, Tensor]:
    """logits [n, V]; rows [n] each logits row's batch row; temperature [R] the batch's;
    uniform [n] float64 -> (probs [n, V] float32, tokens [n] int64): `sampling_probs` then
    `sample_tokens`'s draw, for a batch that filters nothing."""
    return _draw(logits, temperature[rows], None, None, uniform)


def draw_filtered(logits: Tensor, rows: Tensor, temperature: Tensor, top_k: Tensor,
                  top_p: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """`draw` with the batch's top-k [R] int64 (off: <= 0) and top-p [R] float32 (off: 1)."""
    return _draw(logits, temperature[rows], top_k[rows], top_p[rows], uniform)


def verify(logits: Tensor, req_rows: Tensor, temperature: Tensor, owner: Tensor, slot: Tensor,
           ids: Tensor, draft_probs: Tensor, num_drafts: Tensor,
           uniform: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A middle round's chunk of n requests, for a batch that filters nothing: logits [T, V]
    of their pass rows; req_rows [n] their batch rows; owner [T] each pass row's request
    (indices of the round's requests: the chunk's first is owner[0]) and slot [T] its
    index among that request's inputs; ids [n, G] the small draft's proposals and
    draft_probs [n, G, V] their distributions; num_drafts [n]; uniform [n, G + 1] float64
    -> (output_token_ids [n, G + 1], num_accepted [n], target_probs [n, G + 1, V]), as
    `verify` of `_RoundLayout.per_request` of `sampling_probs` gives them."""
    return _verify(logits, req_rows, temperature, None, None, owner, slot, ids, draft_probs,
                   num_drafts, uniform)


def verify_filtered(logits: Tensor, req_rows: Tensor, temperature: Tensor, top_k: Tensor,
                    top_p: Tensor, owner: Tensor, slot: Tensor, ids: Tensor,
                    draft_probs: Tensor, num_drafts: Tensor,
                    uniform: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`verify` with the batch's top-k and top-p (as `draw_filtered`)."""
    return _verify(logits, req_rows, temperature, top_k, top_p, owner, slot, ids, draft_probs,
                   num_drafts, uniform)


def _draw(logits, temperature, top_k, top_p, uniform):
    greedy = temperature < GREEDY_TEMPERATURE
    probs = _rows_probs(logits, temperature, greedy, top_k, top_p, False)
    return probs, sample_drawn(probs, greedy, uniform)


def _verify(logits, req_rows, temperature, top_k, top_p, owner, slot, ids, draft_probs,
            num_drafts, uniform):
    torch._check(ids.shape[1] > 0)  # a round that verifies proposes at least one token
    owner = owner - owner[0]  # each pass row's request within the chunk
    token_rows = req_rows[owner]
    per_token = temperature[token_rows]
    probs = _rows_probs(logits, per_token, per_token < GREEDY_TEMPERATURE,
                        None if top_k is None else top_k[token_rows],
                        None if top_p is None else top_p[token_rows], False)
    p = probs.new_zeros(ids.shape[0], ids.shape[1] + 1, probs.shape[-1])
    p[owner, slot] = probs
    result = verify_drawn(p, ids, draft_probs, num_drafts,
                          temperature[req_rows] < GREEDY_TEMPERATURE, uniform)
    return result.output_token_ids, result.num_accepted, p


EAGER = {fn.__name__: fn for fn in (draw, draw_filtered, verify, verify_filtered)}


class CompiledSampling:
    """The four functions above, compiled once (`warm_up`) for the engine's logits dtype and
    vocabulary, every other size unbacked: a batch, chunk or proposal count never seen
    compiles nothing. `calls` counts the calls by name (tests and benchmarks read it)."""

    def __init__(self, logits_dtype: torch.dtype):
        self.logits_dtype = logits_dtype
        self._compiled: dict[str, CompiledFunction] | None = None
        self.calls = dict.fromkeys(EAGER, 0)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def draw(self, logits: Tensor, rows: Tensor, batch, uniform: Tensor):
        """(probs [n, V], tokens [n]) of logits [n, V], logits row i belonging to batch row
        rows[i] of `batch` (a StepBatch: its temperature, top-k and top-p)."""
        top_k, top_p = _filters(batch)
        if top_k is None:
            return self._call("draw", logits, rows, batch.temperature, uniform)
        return self._call("draw_filtered", logits, rows, batch.temperature, top_k, top_p,
                          uniform)

    def verify(self, logits: Tensor, req_rows: Tensor, batch, owner: Tensor, slot: Tensor,
               ids: Tensor, draft_probs: Tensor, num_drafts: Tensor, uniform: Tensor):
        """(output_token_ids, num_accepted, target_probs) of a middle chunk (`verify`)."""
        top_k, top_p = _filters(batch)
        if top_k is None:
            return self._call("verify", logits, req_rows, batch.temperature, owner, slot, ids,
                              draft_probs, num_drafts, uniform)
        return self._call("verify_filtered", logits, req_rows, batch.temperature, top_k, top_p,
                          owner, slot, ids, draft_probs, num_drafts, uniform)

    def _call(self, name: str, logits: Tensor, *args: Tensor):
        self.calls[name] += 1
        if logits.dtype != self.logits_dtype:  # compiled for one dtype only
            logits = logits.to(self.logits_dtype)
        if self._compiled is None:
            return EAGER[name](logits, *args)
        try:
            return self._compiled[name](*[inference(dense(t)) for t in (logits, *args)])
        except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
            logger.warning("TriForce compiled_sampling: the compiled %s failed (%s: %s); "
                           "sampled rounds run their vocabulary work eagerly from now on.",
                           name, type(exc).__name__, first_line(exc))
            self._compiled = None
            return EAGER[name](logits, *args)

    def warm_up(self, vocab_size: int, device) -> float:
        """Compile all four now, on `device` (3 requests, 2 proposals each): the seconds it
        took. A compilation that fails raises and leaves every function eager."""
        start = time.perf_counter()
        compiled = {name: CompiledFunction(fn) for name, fn in EAGER.items()}
        with torch.inference_mode():
            for name, args in _warm_up_args(vocab_size, self.logits_dtype, device).items():
                compiled[name](*args, compile_now=True)
        self._compiled = compiled
        return time.perf_counter() - start


def _filters(batch) -> tuple[Tensor | None, Tensor | None]:
    """The batch's (top_k, top_p), both tensors where either is (the other's neutral value
    in its place: top-k 0, top-p 1), or both None."""
    top_k, top_p = batch.top_k, batch.top_p
    if top_k is None and top_p is None:
        return None, None
    if top_k is None:
        top_k = torch.zeros(top_p.shape, dtype=torch.long, device=top_p.device)
    if top_p is None:
        top_p = torch.ones(top_k.shape, dtype=torch.float32, device=top_k.device)
    return top_k.long(), top_p.float()


def _warm_up_args(vocab_size: int, dtype: torch.dtype, device) -> dict[str, list[Tensor]]:
    """Each function's warm-up arguments, the sizes that vary marked unbacked (rows,
    requests, pass rows, proposals) and the vocabulary static."""
    n, gamma = 3, 2
    tokens = n * (gamma + 1)

    def new(fill, *shape, dtype=torch.float32):
        return torch.full(shape, fill, dtype=dtype, device=device)

    logits = torch.randn(tokens, vocab_size, device=device).to(dtype)
    rows = torch.arange(n, device=device)
    temperature, top_k, top_p = new(0.5, n), new(0, n, dtype=torch.long), new(1.0, n)
    owner = torch.arange(n, device=device).repeat_interleave(gamma + 1)
    slot = torch.arange(gamma + 1, device=device).repeat(n)
    ids = new(0, n, gamma, dtype=torch.long)
    draft_probs = new(1.0 / vocab_size, n, gamma, vocab_size)
    num_drafts = new(gamma, n, dtype=torch.long)
    one, per_slot = new(0.5, n, dtype=torch.float64), new(0.5, n, gamma + 1, dtype=torch.float64)
    for t in (logits, rows, temperature, top_k, top_p, owner, slot, ids, draft_probs,
              num_drafts, one, per_slot):
        mark_unbacked(t, 0)
    for t in (ids, draft_probs, per_slot):
        mark_unbacked(t, 1)  # proposals
    for t in (logits, draft_probs):
        mark_static(t, t.dim() - 1)  # the vocabulary
    first = torch.randn(n, vocab_size, device=device).to(dtype)  # a draw's logits
    mark_unbacked(first, 0)
    mark_static(first, 1)
    return {
        "draw": [first, rows, temperature, one],
        "draw_filtered": [first, rows, temperature, top_k, top_p, one],
        "verify": [logits, rows, temperature, owner, slot, ids, draft_probs, num_drafts,
                   per_slot],
        "verify_filtered": [logits, rows, temperature, top_k, top_p, owner, slot, ids,
                            draft_probs, num_drafts, per_slot],
    }
