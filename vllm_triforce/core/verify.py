"""Exact speculative sampling, used at both levels of the hierarchy.

Terms (as in vLLM's rejection sampler). A lower level proposes G "draft" tokens x_i
drawn from q_i; the upper level has probabilities p_i at each of the G + 1 positions.
Draft i is "accepted" if u_i < p_i(x_i) / q_i(x_i) (u_i uniform) and every earlier
draft was accepted. At the first rejected position a "recovered" token is drawn from
the residual normalize(max(p_i - q_i, 0)); if all valid drafts are accepted a "bonus"
token is drawn from p at the next position. Either way exactly one token follows the
accepted drafts, and every emitted token is distributed exactly as p at its position.

The hierarchy (small draft -> middle = target on a retrieval cache -> full target):
the middle level runs `verify` with the small draft's q and its own p, and the tokens
it emits are then proposals to the full target. Their proposal distribution, the q
the full level must use, is the middle level's p at those positions (accepted,
recovered and bonus tokens alike), because that is what each was distributed as.
The reference code (TriForce utils/decoding.py, Middle_Spec) gets this wrong: on a
middle rejection it samples from p_middle instead of the residual but still hands
p_middle upward, so its output is not the target's distribution. Counter-example
(tested): draft always proposes a, middle = target = (1/2, 1/2) -> the reference
emits a with probability 3/4.

Worked example (one row, G = 3, num_drafts = 3): drafts [a, b, c], draft 0 accepted,
draft 1 rejected -> output_token_ids = [a, r, -1, -1] with r drawn from the residual at
position 1, num_accepted = 1 (emitted = 2).

Randomness: G + 1 uniforms per row, drawn regardless of the outcome (one per draft slot,
one for the final token, which is drawn by inverting the float64 cumulative sum of its
unnormalised distribution), so a seeded per-row generator makes a row reproducible. An
all-greedy batch whose `greedy` flags are on the host draws nothing and skips the
vocabulary-wide sampling work. The final token is drawn by inverse CDF, not in the
argmax(dist / Exp(1)) form, which draws a vocabulary's worth of Exp(1) noise per row: the
inverse CDF needs one uniform per row and never syncs a GPU either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from vllm_triforce.core.tensors import on_device

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy (as vLLM's _SAMPLING_EPS)


# Rows of logits transformed at once: bounds the temporaries (a few vocabulary rows per row,
# engine/buffers.py SAMPLING_ROWS_PER_ROW) whatever the batch, while each chunk stays large
# enough that its work, not the host's kernel launches, sets its time
# (benchmarks/explore/sampling_chunks.py measures both on a GPU).
SAMPLING_CHUNK_ROWS = 64


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor | None = None,
                   top_p: Tensor | None = None, all_greedy: bool | None = None) -> Tensor:
    """[N, V] logits -> [N, V] float32 probs: logits / T, then top-k, then top-p, softmax.

    top-k keeps every token tied with the k-th largest (as vLLM); top-k <= 0 or >= V is
    off. top-p keeps the smallest prefix of the sorted tokens with mass >= p, always
    the argmax; top-p >= 1 is off. Rows with T < 1e-5 are greedy: one-hot argmax.
    NaN logits count as -inf; a row with no finite probability becomes uniform.
    `all_greedy`: whether every row is greedy, if the caller knows it on the host (else
    it is read from `temperature`: a device sync on a GPU).

    Memory: the output, plus the temporaries of at most SAMPLING_CHUNK_ROWS rows at a time
    (under top-p a few vocabulary rows each, more on CUDA, where the sort keeps its own
    double buffers: engine/buffers.py SAMPLING_ROWS_PER_ROW), whatever N: engine/memory.py
    reserves them as a fixed amount. Rows are independent: on a CPU the chunks give the
    values of one pass bit for bit (tested); CUDA kernels may pick another algorithm for
    another row count, so there the last bits of a row can depend on its chunk's size.
    """
    temperature = on_device(temperature, logits.device, torch.float32)
    greedy = temperature < GREEDY_TEMPERATURE  # [N]
    if all_greedy is None:
        all_greedy = bool(greedy.all())
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], SAMPLING_CHUNK_ROWS):
        rows = slice(start, start + SAMPLING_CHUNK_ROWS)
        out[rows] = _rows_probs(logits[rows], temperature[rows], greedy[rows],
                                None if top_k is None else top_k[rows],
                                None if top_p is None else top_p[rows], all_greedy)
    return out


def _rows_probs(logits: Tensor, temperature: Tensor, greedy: Tensor, top_k: Tensor | None,
                top_p: Tensor | None, all_greedy: bool) -> Tensor:
    """`sampling_probs` of one chunk of rows, working in place on one float32 copy: under
    top-p at most about 6 vocabulary rows per logits row are alive at once (the copy, sort
    values, int64 order, softmax and cumulative mass)."""
    big = torch.finfo(torch.float32).max
    x = logits.to(torch.float32, copy=True).nan_to_num_(nan=float("-inf"), posinf=big,
                                                         neginf=float("-inf"))
    argmax = x.argmax(-1, keepdim=True)  # [n, 1]
    if all_greedy:  # the common greedy batch: no softmax over the vocabulary
        return x.zero_().scatter_(1, argmax, 1.0)
    x.div_(torch.where(greedy, 1.0, temperature)[:, None]).clamp_(max=big)
    if top_k is not None or top_p is not None:
        _top_k_top_p_(x, top_k, top_p)
    probs = x.softmax(-1)
    del x
    bad = ~torch.isfinite(probs).all(-1, keepdim=True)  # [n, 1]
    probs.masked_fill_(bad, 1.0 / probs.shape[-1])
    one = torch.where(greedy[:, None], 1.0, probs.gather(1, argmax))  # [n, 1]
    return probs.masked_fill_(greedy[:, None], 0.0).scatter_(1, argmax, one)


def _top_k_top_p_(scaled: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> None:
    """Mask (to -inf, in place) what top-k then top-p drop, working on the descending sort."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(-1, descending=True)  # [N, V]
    if top_k is not None:
        k = on_device(top_k, scaled.device, torch.long)
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)
        kth = values.gather(1, (k - 1)[:, None])  # [N, 1]
        values.masked_fill_(values < kth, float("-inf"))
    if top_p is not None:
        p = on_device(top_p, scaled.device, torch.float32)[:, None]
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1).sub_(probs)  # mass of the strictly higher-ranked tokens
        del probs
        drop = (mass_before >= p) & (p < 1)
        del mass_before
        drop[:, 0] = False  # always keep the argmax
        values.masked_fill_(drop, float("-inf"))
    scaled.scatter_(1, order, values)


@dataclass
class VerifyResult:
    # [R, G + 1] int64: accepted drafts, then one recovered/bonus token, padded with -1
    output_token_ids: Tensor
    # [R] int64 drafts accepted (tokens emitted = num_accepted + 1)
    num_accepted: Tensor


def verify(draft_token_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
           num_drafts: Tensor, greedy: Tensor,
           generators: Sequence[torch.Generator | None] | None = None,
           all_greedy: bool | None = None,
           shared: torch.Generator | None = None) -> VerifyResult:
    """Standard speculative sampling of one level (module docstring).

    draft_token_ids [R, G]; draft_probs [R, G, V] or None (drafts are one-hot, i.e.
    proposed deterministically); target_probs [R, G + 1, V]; num_drafts [R] <= G valid
    drafts per row (slots past it are ignored); greedy [R] bool: accept while the draft
    equals argmax p, then emit argmax p (pass it on the host: an all-greedy batch then
    draws nothing). generators: one per row (a seeded request's: its row is reproducible
    whatever the batch); rows with a None entry, or all with a None list, draw together
    from `shared` (None: the default RNG). `all_greedy`: whether every row is greedy, if
    known on the host.
    """
    num_reqs, gamma = draft_token_ids.shape
    device = target_probs.device
    p = target_probs.float().nan_to_num(0.0).clamp_(min=0)  # [R, G+1, V], a new tensor
    if all_greedy is None and greedy.device.type == "cpu":  # checked without a device sync
        all_greedy = bool(greedy.all())
    if all_greedy:
        return verify_greedy(draft_token_ids, p.argmax(-1), num_drafts)
    ids = on_device(draft_token_ids, device, torch.long)
    uniform = draw_uniforms(num_reqs, gamma + 1, generators, device, shared)  # [R, G+1]
    return verify_drawn(p, ids, None if draft_probs is None else on_device(draft_probs, device),
                        on_device(num_drafts, device, torch.long),
                        on_device(greedy, device, torch.bool), uniform)


def verify_drawn(p: Tensor, ids: Tensor, draft_probs: Tensor | None, num_drafts: Tensor,
                 greedy: Tensor, uniform: Tensor) -> VerifyResult:
    """`verify`'s work once its uniforms are drawn, every input on one device: p [R, G + 1,
    V] float32, non-negative; ids [R, G] int64 (padding may be -1); draft_probs [R, G, V]
    or None (one-hot drafts); num_drafts [R] int64; greedy [R] bool; uniform [R, G + 1]
    float64 (one per draft slot, the last for the final token). No host decision and no
    draw: core/compiled_sampling.py compiles it as it is."""
    gamma = ids.shape[1]
    safe_ids = ids.clamp(0, p.shape[-1] - 1)[..., None]  # [R, G, 1]; padding may be -1
    p_draft = p[:, :gamma].gather(2, safe_ids).squeeze(-1)  # [R, G] p(x_i)
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.float().gather(2, safe_ids).squeeze(-1))
    argmax_p = p.argmax(-1)  # [R, G+1]
    accept = torch.where(greedy[:, None], ids == argmax_p[:, :gamma],
                         uniform[:, :gamma] * q_draft < p_draft)
    num_accepted = _num_accepted(accept, num_drafts)  # [R]

    dist = _final_distribution(p, draft_probs, safe_ids, num_accepted, num_drafts)  # [R, V]
    greedy_last = argmax_p.gather(1, num_accepted[:, None]).squeeze(1)  # [R]
    last = torch.where(greedy, greedy_last, _inverse_cdf(dist, uniform[:, -1]))
    return _result(ids, num_accepted, last)


def verify_greedy(draft_token_ids: Tensor, target_argmax: Tensor,
                  num_drafts: Tensor) -> VerifyResult:
    """`verify` when every row is greedy, from the upper level's argmax alone:
    target_argmax [R, G + 1] (its most likely token at each position). Accept while the
    draft equals it, then emit it. No vocabulary-wide work, no randomness."""
    ids = on_device(draft_token_ids, target_argmax.device, torch.long)
    if ids.shape[1] == 0:  # nothing proposed (the level drafting by itself): its argmax
        return VerifyResult(target_argmax[:, :1], target_argmax.new_zeros(ids.shape[0]))
    num_accepted = _num_accepted(ids == target_argmax[:, :ids.shape[1]],
                                 on_device(num_drafts, ids.device, torch.long))
    return _result(ids, num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1))


def _num_accepted(accept: Tensor, num_drafts: Tensor) -> Tensor:
    """accept [R, G] per-slot outcomes -> [R] drafts accepted before the first rejection
    (slots at or past num_drafts [R] count as rejected)."""
    accept = accept & (torch.arange(accept.shape[1], device=accept.device) < num_drafts[:, None])
    return accept.long().cumprod(1).sum(1)


def _result(ids: Tensor, num_accepted: Tensor, last: Tensor) -> VerifyResult:
    """ids [R, G] drafts, num_accepted [R], last [R] the token after them -> the result."""
    num_reqs, gamma = ids.shape
    kept = torch.arange(gamma, device=ids.device) < num_accepted[:, None]
    out = torch.cat([torch.where(kept, ids, -1), ids.new_full((num_reqs, 1), -1)], dim=1)
    out.scatter_(1, num_accepted[:, None], last[:, None])  # [R, G+1]
    return VerifyResult(out, num_accepted)


def _final_distribution(p: Tensor, draft_probs: Tensor | None, safe_ids: Tensor,
                        num_accepted: Tensor, num_drafts: Tensor) -> Tensor:
    """[R, V] what the token after the accepted drafts is drawn from: the residual
    max(p - q, 0) (unnormalised) after a rejection, p itself for a bonus token or when
    the residual has no mass (then p <= q everywhere, i.e. p == q up to rounding)."""
    at = num_accepted[:, None, None].expand(-1, 1, p.shape[-1])  # [R, 1, V]
    p_at = p.gather(1, at).squeeze(1)  # [R, V]
    gamma = safe_ids.shape[1]
    if gamma == 0:
        return p_at
    draft_at = num_accepted.clamp(max=gamma - 1)
    if draft_probs is None:  # one-hot proposal of the draft token
        token = safe_ids.squeeze(-1).gather(1, draft_at[:, None])  # [R, 1]
        q_at = torch.zeros_like(p_at).scatter_(1, token, 1.0)
    else:
        index = draft_at[:, None, None].expand(-1, 1, p.shape[-1])
        q_at = draft_probs.float().gather(1, index).squeeze(1).nan_to_num(0.0)
    residual = (p_at - q_at).clamp(min=0)
    mass = residual.sum(-1)
    use_residual = (num_accepted < num_drafts) & (mass > 0) & torch.isfinite(mass)
    return torch.where(use_residual[:, None], residual, p_at)


def sample_tokens(q: Tensor, greedy: Tensor, generators: Sequence[torch.Generator | None],
                  shared: torch.Generator | None, all_greedy: bool = False) -> Tensor:
    """One token per row of q [n, V] (non-negative, unnormalised allowed), on the device:
    the argmax for rows with greedy [n] (bool, on the device) set, else a draw from q with
    the row's own generator (seeded requests: reproducible whatever the batch) or, for
    None entries, one batched draw from `shared`. `all_greedy` (host): no draw at all.

    Drawn by inverting the float64 cumulative sum with one uniform per row (as `verify`'s
    final token), not with `torch.multinomial`, which synchronises a GPU (vLLM's sampler
    avoids it for the same reason: vllm/v1/sample/ops/topk_topp_sampler.py, random_sample)."""
    if all_greedy:
        return q.argmax(-1)
    uniform = draw_uniforms(q.shape[0], 1, generators, q.device, shared)[:, 0]
    return sample_drawn(q, on_device(greedy, q.device, torch.bool), uniform)


def sample_drawn(q: Tensor, greedy: Tensor, uniform: Tensor) -> Tensor:
    """`sample_tokens` once its uniforms [n] (float64) are drawn, greedy [n] bool on q's
    device: no host decision and no draw (core/compiled_sampling.py compiles it)."""
    return torch.where(greedy, q.argmax(-1), _inverse_cdf(q, uniform))


def draw_uniforms(num_reqs: int, count: int, generators, device,
          shared: torch.Generator | None = None) -> Tensor:
    """[R, count] float64 uniforms in [0, 1): a row with its own generator draws from it
    (the values `torch.rand(count, generator=gen)` gives), the others in one draw from
    `shared` (None: the default RNG)."""
    if generators is not None and len(generators) != num_reqs:
        raise ValueError(f"{len(generators)} generators for {num_reqs} rows")
    uniform = torch.rand(num_reqs, count, dtype=torch.float64, device=device, generator=shared)
    for j, gen in enumerate(generators or ()):
        if gen is not None:  # in place: one launch a seeded row
            uniform[j].uniform_(generator=gen)
    return uniform


def _inverse_cdf(dist: Tensor, uniform: Tensor) -> Tensor:
    """One token per row of `dist` [R, V] (non-negative, unnormalised), drawn with
    `uniform` [R] in [0, 1): the first index whose float64 cumulative mass exceeds
    uniform * total. A zero-mass token never is: its cumulative mass equals its
    predecessor's."""
    cdf = dist.double().cumsum(-1)  # [R, V]
    target = (uniform * cdf[:, -1])[:, None]  # [R, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=dist.shape[-1] - 1)
