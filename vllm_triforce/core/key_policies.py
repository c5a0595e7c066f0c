"""The policies that read keys: each block's exact attention mass.

  topk_oracle  exact attention mass per block (softmax over all committed keys).
               Reference only: reads every key (BlockSummaries' key copy).
  h2o          the oracle's mass accumulated over every query observed so far
               (per request, in a `scoring.SelectionState`).
  rerank       two stages: `retrieval` shortlists `factor` x the blocks to select per
               layer, the exact attention mass re-ranks the shortlist (reads the keys of
               the shortlist and of the always-kept blocks only; see
               `selection.rerank_exactly`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vllm_triforce.core.scoring import SelectionPolicy, SelectionState, group_query
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.summary_policies import RetrievalPolicy
from vllm_triforce.core.tensors import on_device


class TopKOraclePolicy(SelectionPolicy):
    """Exact attention mass per block: softmax over all committed keys, per query head,
    summed within each block and over all heads. Reference only (reads every key).
    strategy as RetrievalPolicy: "all" scores every physical block's keys once per
    layer for the whole batch, "gather" reads each request's keys, "auto" picks."""
    name = "topk_oracle"

    def __init__(self, scale: float | None = None, strategy: str = "auto"):
        if strategy not in ("auto", "gather", "all"):
            raise ValueError(f"strategy must be 'auto', 'gather' or 'all', not {strategy!r}")
        self.scale = scale  # None: 1 / sqrt(head_dim)
        self.strategy = strategy

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        return self.block_mass(query, summaries, block_table, num_committed)

    def block_mass(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                   num_committed: Tensor) -> Tensor:
        """[R, L, B] float32 attention mass of each block (each head's mass sums to 1)."""
        if summaries.keys is None:
            raise ValueError(f"policy {self.name!r} needs BlockSummaries(keep_keys=True)")
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        ids = on_device(block_table, summaries.device, torch.long).clamp(min=0)  # [R, B]
        num_committed = on_device(num_committed, summaries.device, torch.long)
        use_all = (self.strategy == "all" or
                   self.strategy == "auto" and summaries.num_blocks <= 2 * ids.numel())
        mass = torch.zeros(*q.shape[:2], ids.shape[1], device=q.device)  # [R, L, B]
        for layer in range(q.shape[1]):  # one layer at a time: keys are the big tensor
            keys = summaries.keys[layer]  # [N, bs, H, D]
            if use_all:
                logits = torch.einsum("rhgd,nthd->rhgnt", q[:, layer], keys.float())
                index = ids[:, None, None, :, None].expand(*logits.shape[:3], -1, logits.shape[-1])
                mass[:, layer] = _mass(logits.gather(3, index), num_committed)
                continue
            for r in range(q.shape[0]):
                logits = torch.einsum("hgd,bthd->hgbt", q[r, layer], keys[ids[r]].float())
                mass[r, layer] = _mass(logits[None], num_committed[r:r + 1])[0]
        return mass


def _mass(logits: Tensor, num_committed: Tensor) -> Tensor:
    """logits [R, H, G, B, bs] of every table token -> [R, B] softmax mass per block,
    summed over the H*G query heads; tokens at or past num_committed get none."""
    num_blocks, block_size = logits.shape[-2:]
    token = torch.arange(num_blocks * block_size, device=logits.device)
    flat = logits.flatten(3).masked_fill(token >= num_committed[:, None, None, None], float("-inf"))
    probs = flat.softmax(-1).nan_to_num(0.0)
    return probs.view(logits.shape).sum((1, 2, 4))


class H2OPolicy(TopKOraclePolicy):
    """Heavy hitters: the oracle's block mass accumulated over every observed query.

    `state` is one SelectionState per request (a sequence aligned with the rows, or a
    single state when num_reqs == 1). A row without state scores by its current mass
    only. Call `observe` after decode steps to accumulate queries between selections.
    """
    name = "h2o"

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        states = _per_request(state, query.shape[0])
        mass = self.block_mass(query, summaries, block_table, num_committed)  # [R, L, B]
        scores = mass.clone()
        for r, req_state in enumerate(states):
            if req_state is None:
                continue
            req_state.accumulate(mass[r])
            acc = req_state.block_mass[:, :mass.shape[-1]]
            scores[r, :, :acc.shape[-1]] = acc
        return scores

    def observe(self, query, summaries, block_table, num_committed, state=None):
        states = _per_request(state, query.shape[0])
        mass = self.block_mass(query, summaries, block_table, num_committed)
        for r, req_state in enumerate(states):
            if req_state is not None:
                req_state.accumulate(mass[r])


def _per_request(state, num_reqs: int) -> list:
    if state is None:
        return [None] * num_reqs
    if isinstance(state, SelectionState):
        if num_reqs != 1:
            raise ValueError("a single SelectionState needs num_reqs == 1; pass one per request")
        return [state]
    states = list(state)
    if len(states) != num_reqs:
        raise ValueError(f"{len(states)} states for {num_reqs} requests")
    return states


class RerankPolicy(RetrievalPolicy):
    """`retrieval`'s scores shortlist, exact attention mass decides.

    block_scores are RetrievalPolicy's; `selection.rerank_exactly` then keeps each layer's
    best `factor` x num_select candidates by them and replaces their scores by
    `exact_scores`: per query head, the softmax over the keys of the shortlist and of the
    blocks every selection keeps (sinks, recent, tail), summed within each listed block
    and over the heads. With a shortlist holding every candidate this is the Top-K
    oracle's mass (see tests). The keys come from a key source: in the engine vLLM's own
    paged KV cache (engine/paged_keys.py), in the benchmarks BlockSummaries' copy; it reads
    (factor x num_select + sinks + recent + 1) blocks of keys per layer and request.
    """
    name = "rerank"  # between middle rounds: both stages again (no shortlist re-ranking)

    def __init__(self, factor: int = 4, variance: bool = True, scale: float | None = None):
        super().__init__(variance=variance, scale=scale)
        if not isinstance(factor, int) or factor < 1:
            raise ValueError(f"factor must be a positive int, not {factor!r}")
        self.factor = factor

    def exact_scores(self, query: Tensor, keys, listed: Tensor, kept: Tensor,
                     kept_tokens: Tensor) -> Tensor:
        """listed [R, L, S] physical ids (-1: padding) -> [R, L, S] float32 attention mass.
        kept [R, K] physical ids (-1: padding) of the blocks attended anyway and
        kept_tokens [R, K] their committed tokens (listed blocks are full). `keys`: a key
        source (`head_keys(layer, head, ids)` -> [*ids.shape, D, bs], `num_kv_heads`,
        `block_size`, `device`): BlockSummaries(keep_keys=True) or engine PagedKeys.
        One KV head at a time, so each product is one batched matmul over the keys as the
        source lays them out."""
        q = group_query(query, keys.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        num_reqs, num_layers, size = listed.shape
        device = keys.device
        listed, kept = on_device(listed, device, torch.long), on_device(kept, device, torch.long)
        offset = torch.arange(keys.block_size, device=device)
        kept_valid = (offset < on_device(kept_tokens, device)[..., None]) & (kept >= 0)[..., None]
        mass = torch.zeros(num_reqs, num_layers, size, device=q.device)
        for layer in range(num_layers):  # one layer at a time: keys are the big tensor
            ids = torch.cat([listed[:, layer], kept], dim=1)  # [R, S + K]
            valid = torch.cat([(listed[:, layer] >= 0)[..., None].expand(-1, -1, offset.numel()),
                               kept_valid], dim=1)  # [R, S + K, bs]
            logits = torch.stack([
                q[:, layer, h, None] @ keys.head_keys(layer, h, ids.clamp(min=0)).float()
                for h in range(keys.num_kv_heads)], dim=1)  # [R, H, S + K, G, bs]
            logits = logits.masked_fill(~valid[:, None, :, None], float("-inf"))
            probs = logits.transpose(2, 3).flatten(3).softmax(-1).nan_to_num(0.0)  # [R,H,G,.]
            listed_probs = probs.unflatten(-1, (ids.shape[1], -1))[:, :, :, :size]
            mass[:, layer] = listed_probs.sum((1, 2, 4))
        return mass
