"""Block scoring policies for the paper's comparisons, behind one interface.

Every policy maps the query of each request's latest committed token to one score
per logical block and layer, higher = keep; `selection.select_blocks` does the rest.

  retrieval    TriForce: query . mean post-RoPE key of the block, per query head,
               aggregated over the query heads of each KV group and over KV heads;
               with `variance`, plus 1/2 sum_d q_d^2 var_d (the keys' per-channel
               variance in the block): a second-order estimate of log E[exp(q . k)].
  quest        Quest (Tang et al. 2024): per query head, the upper bound
               sum_d max(q_d min_d, q_d max_d) of q . k over the block's keys, from
               per-channel key bounds; aggregated over the layer's query heads.
  streamingllm sinks + the most recent blocks (the score is the block index).
  topk_oracle  exact attention mass per block (softmax over all committed keys).
               Reference only: reads every key.
  h2o          the oracle's mass accumulated over every query observed so far.
  rerank       two stages: `retrieval` shortlists `factor` x the blocks to select per
               layer, the exact attention mass re-ranks the shortlist (reads the keys of
               the shortlist and of the always-kept blocks only; benchmarks: needs the
               key copy, see `selection.rerank_exactly`).

Shapes: query [num_reqs, num_layers, num_q_heads, head_dim] (post-RoPE);
block_table [num_reqs, max_blocks] physical ids; num_committed [num_reqs];
scores [num_reqs, num_layers, max_blocks] float32. GQA: query head h reads KV head
h // (num_q_heads // num_kv_heads), as in vLLM and HF (repeat_kv).

Aggregation: vLLM's kernels take one block table per layer, so per-head scores
[R, L, Hkv, G, B] become one score per block: "sum" over all query heads, "max" over
them (a block one head needs strongly wins), or "softmax" (each head's scores normalised
over the full committed blocks first, then summed: every head spends one unit of mass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from vllm_triforce.core.blocks import full_block_mask
from vllm_triforce.core.policy_facts import POLICY_FACTS
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.tensors import on_device

States = "SelectionState | Sequence[SelectionState | None] | None"


@dataclass
class SelectionState:
    """Per-request selection state: create it with the request, drop it with the request."""
    # [num_layers, num_logical_blocks] float32 attention mass accumulated per logical
    # block (h2o); grows as the request gets new blocks.
    block_mass: Tensor | None = None
    num_observed: int = 0  # queries accumulated into block_mass

    def accumulate(self, mass: Tensor) -> None:
        """mass [num_layers, num_blocks]: add one query's per-block attention mass."""
        if self.block_mass is None:
            self.block_mass = torch.zeros_like(mass)
        grow = mass.shape[-1] - self.block_mass.shape[-1]
        if grow > 0:
            self.block_mass = torch.nn.functional.pad(self.block_mass, (0, grow))
        self.block_mass[:, :mass.shape[-1]] += mass
        self.num_observed += 1

    def nbytes(self) -> int:
        return 0 if self.block_mass is None else self.block_mass.nbytes


def group_query(query: Tensor, num_kv_heads: int) -> Tensor:
    """[R, L, Hq, D] -> [R, L, Hkv, G, D] float32, G = Hq // Hkv query heads per KV head."""
    num_reqs, num_layers, num_q_heads, head_dim = query.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group onto {num_kv_heads} KV heads")
    return query.float().view(num_reqs, num_layers, num_kv_heads, -1, head_dim)


AGGREGATIONS = ("sum", "max", "softmax")


def aggregate_heads(per_head: Tensor, aggregation: str, candidates: Tensor) -> Tensor:
    """per_head [R, L, H, G, B] -> [R, L, B]; candidates [R, B] bool is the softmax domain."""
    if aggregation == "sum":
        return per_head.sum((2, 3))
    if aggregation == "max":
        return per_head.amax((2, 3))
    mask = candidates[:, None, None, None, :]
    probs = per_head.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs.sum((2, 3))


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")


class SelectionPolicy:
    """Base: one score per logical block and layer; higher = keep. A subclass registered in
    `policy_facts.POLICY_FACTS` under its `name` takes its flags from there."""
    name: str = ""
    needs_keys: bool = False  # reads BlockSummaries(keep_keys=True)
    needs_bounds: bool = False  # ... BlockSummaries(keep_bounds=True)
    needs_variance: bool = False  # ... BlockSummaries(keep_variance=True) (per instance)
    reranks_shortlist: bool = False  # implements `shortlist_scores`

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        facts = POLICY_FACTS.get(cls.name)
        if facts is not None:
            cls.needs_keys, cls.needs_bounds = facts.copies_keys, facts.keeps_bounds
            cls.reranks_shortlist = facts.reranks_shortlist

    def block_scores(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                     num_committed: Tensor, state: States = None) -> Tensor:
        """[num_reqs, num_layers, max_blocks] float32."""
        raise NotImplementedError

    def observe(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                num_committed: Tensor, state: States = None) -> None:
        """See a query without selecting (only h2o accumulates anything)."""

    def shortlist_scores(self, query: Tensor, summaries: BlockSummaries, blocks: Tensor,
                         rows: Tensor | None = None, counts: Tensor | None = None,
                         copy: Tensor | None = None) -> Tensor:
        """blocks [R, L, S] physical ids per layer (-1: padding) -> [R, L, S] float32 scores
        of only those blocks (between middle rounds: selection.Shortlist). `rows`,
        `counts`: the blocks' `layer_rows` and token counts (>= 1), where the caller kept
        them (`Shortlist.summary_rows`); `copy`: what `listed_copy` made of them."""
        raise NotImplementedError(f"policy {self.name!r} does not re-rank a shortlist")

    def listed_copy(self, summaries: BlockSummaries, rows: Tensor,
                    counts: Tensor) -> Tensor | None:
        """The listed blocks' summaries as `shortlist_scores` reads them, copied once for a
        step's middle rounds, or None (no copy: each re-ranking reads the stores)."""
        return None


class StreamingLLMPolicy(SelectionPolicy):
    """Sinks + a contiguous recent window: the most recent candidates win."""
    name = "streamingllm"

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        num_reqs, num_layers = query.shape[:2]
        order = torch.arange(block_table.shape[1], device=block_table.device, dtype=torch.float32)
        return order.expand(num_reqs, num_layers, -1).clone()


# Scoring every physical block ("all" strategies) reads the summary store [L, N, H, D] in
# chunks of blocks, each cast to float32 on its own: with bf16 summaries a whole-store
# float32 copy would be twice the store (~4 GB for a 60 GB KV cache) at every selection.
SCORE_CHUNK_BYTES = 64 * 2**20


def read_limit(summaries) -> int:
    """The most one chunked read of `summaries` (or of the keys they summarise) copies:
    SCORE_CHUNK_BYTES, or the smaller read chunk the engine's memory plan sized for a small
    cache (`BlockSummaries.chunk_bytes`, engine/memory.py)."""
    chunk_bytes = getattr(summaries, "chunk_bytes", None)
    return SCORE_CHUNK_BYTES if chunk_bytes is None else min(SCORE_CHUNK_BYTES, chunk_bytes)


def block_chunks(store: Tensor, limit: int | None = None) -> list[slice]:
    """Slices of the store's block axis whose float32 copy (all layers, heads and channels)
    takes at most `limit` (None: SCORE_CHUNK_BYTES), or one block when a block alone takes
    more. Example: L=32, H=8, D=128 -> 128 KiB per block in float32 -> 512 blocks per chunk."""
    num_blocks = store.shape[1]
    block_bytes = store[:, :1].numel() * 4  # float32
    per_chunk = max(1, (limit or SCORE_CHUNK_BYTES) // max(1, block_bytes))
    return [slice(start, start + per_chunk) for start in range(0, num_blocks, per_chunk)]


def gather_chunks(store: Tensor, ids: Tensor, limit: int | None = None) -> list[slice]:
    """Slices of the table axis of ids [R, B] whose gathered float32 copy (every request's
    blocks, all layers, heads and channels) takes at most `limit` (None: SCORE_CHUNK_BYTES,
    the one in this example). Example:
    Llama-3.1-8B (L=32, H=8, D=128), one 128K request (B=8,192): 512 blocks per chunk,
    64 MiB each, where one gather would copy 1 GiB."""
    column_bytes = store[:, :1].numel() * 4 * max(1, ids.shape[0])  # float32
    per_chunk = max(1, (limit or SCORE_CHUNK_BYTES) // max(1, column_bytes))
    return [slice(start, start + per_chunk) for start in range(0, ids.shape[1], per_chunk)]


def _gathered(store: Tensor, ids: Tensor) -> Tensor:
    """store [L, N, H, D] at ids [R, b] -> [L, R, b, H, D] float32 (`index_select`: on a
    CPU 3x faster than advanced indexing of the block axis)."""
    return store.index_select(1, ids.flatten()).float().unflatten(1, ids.shape)


def rows_dot(weights: Tensor, rows: Tensor) -> Tensor:
    """weights [R, L, K] . rows [R, L, S, K] (any strides) -> [R, L, S]: one batched
    vector-matrix product over a transposed view, no copy of `rows` (on a CPU 4x faster
    than the einsum's matrix-vector products at a middle round's sizes)."""
    num_reqs, num_layers, num_rows, channels = rows.shape
    batch = num_reqs * num_layers
    dots = torch.bmm(weights.reshape(batch, 1, channels),
                     rows.reshape(batch, num_rows, channels).transpose(1, 2))
    return dots.view(num_reqs, num_layers, num_rows)


def score_chunks(store: Tensor, limit: int | None = None) -> list[slice]:
    """`block_chunks`, except that a float32 store is read in place, whole (its `.float()`
    copies nothing), so float32 scores stay what one product gives."""
    return [slice(None)] if store.dtype == torch.float32 else block_chunks(store, limit)


class RetrievalPolicy(SelectionPolicy):
    """TriForce retrieval: q . mean_key / sqrt(d), aggregated to one score per block.

    aggregation="sum" (default) sums the raw scaled dot products over the query heads
    of a group and over KV heads. It is the reference code's score (TriForce, MHA) and
    the one the engine uses (`bench acceptance` measures it: benchmarks/RESULTS.md); being
    linear in q it is one dot product with the group-summed query, the cheapest option.
    aggregation="softmax" first normalises each query head with a softmax over the
    blocks (full committed blocks, or `candidates` if given), then sums, so every head
    spends the same unit of mass and heads with large query norms cannot dominate;
    aggregation="max" keeps each block's best query head.
    strategy: "gather" reads the request's mean keys (by `gather_chunks`, each gathered
    float32 copy at most one read chunk, `read_limit`: SCORE_CHUNK_BYTES = 64 MiB or the
    engine's smaller one); "all" scores every physical block (one read of the whole store,
    cheaper when the store is small, in chunks whose float32 copy is at most one read chunk
    when the store is not float32: `score_chunks`); "auto" picks.
    variance=True adds 1/2 sum_d q_d^2 var_d per query head (q scaled by 1 / sqrt(d), var_d
    the variance of the block's keys in channel d): the log of E[exp(q . k)] if the block's
    keys were independent Gaussians per channel, i.e. the block's attention mass up to a
    constant, where the mean alone is E[q . k]. A block whose mass comes from a few keys far
    along q (a needle) has a large variance there that its mean dilutes. Needs
    BlockSummaries(keep_variance=True); costs one more dot product per block, either strategy.
    """
    name = "retrieval"

    def __init__(self, aggregation: str = "sum", strategy: str = "auto",
                 scale: float | None = None, variance: bool = False):
        _check_aggregation(aggregation)
        self.variance = variance
        self.needs_variance = variance
        if strategy not in ("auto", "gather", "all"):
            raise ValueError(f"strategy must be 'auto', 'gather' or 'all', not {strategy!r}")
        self.aggregation = aggregation
        self.strategy = strategy
        self.scale = scale  # None: 1 / sqrt(head_dim)

    def block_scores(self, query, summaries, block_table, num_committed, state=None,
                     candidates: Tensor | None = None):
        """candidates [R, max_blocks] bool optionally restricts the softmax domain."""
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        ids = on_device(block_table, summaries.device, torch.long).clamp(min=0)  # [R, B]
        if self.aggregation == "sum":  # linear in q: one dot product per KV group
            scores = self._summed_scores(q.sum(3).flatten(2), summaries, ids, summaries.sums)
            if self.variance:
                scores += 0.5 * self._summed_scores(q.square().sum(3).flatten(2), summaries, ids,
                                                    summaries.deviations())
            return scores
        per_head = self._per_head_scores(q, summaries, ids, summaries.sums)  # [R, L, H, G, B]
        if self.variance:
            per_head += 0.5 * self._per_head_scores(q.square(), summaries, ids,
                                                    summaries.deviations())
        if candidates is None:
            candidates = full_block_mask(on_device(num_committed, q.device), summaries.block_size,
                                         block_table.shape[1])
        return aggregate_heads(per_head, self.aggregation, candidates)

    def shortlist_scores(self, query, summaries, blocks, rows=None, counts=None, copy=None):
        """As block_scores, over per-layer block lists (softmax: over the listed blocks),
        read by `gather_chunks`: Llama-3.1-8B's default shortlist (4 x 247 blocks per layer)
        at batch 8 would otherwise gather 2 GiB of float32 rows per re-selection. With
        `copy` (`listed_copy`), read from it: one or two batched products, no store read."""
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        if copy is not None:
            return self._copied_scores(q, copy)
        weights = [(q, summaries.sums)]
        if self.variance:
            weights.append((0.5 * q.square(), summaries.deviations()))
        if counts is None:
            counts = summaries.counts[blocks.clamp(min=0)].clamp(min=1).float()  # [R, L, S]
        if rows is None:
            rows = summaries.layer_rows(blocks)  # one index for every store read
        per_chunk = []  # the listed blocks' rows read by `gather_chunks` of the S axis
        for c in gather_chunks(summaries.sums, blocks[:, 0], read_limit(summaries)):
            # one store's rows at a time ([R, L, s, H, D]), freed before the next is read
            terms = ((w, summaries.rows_of(store, rows[..., c])) for w, store in weights)
            if self.aggregation == "sum":
                per_chunk.append(sum(rows_dot(w.sum(3).flatten(2), v.float().flatten(3))
                                     for w, v in terms))
            else:
                per_chunk.append(sum(torch.einsum("rlhgd,rlshd->rlhgs", w, v.float())
                                     for w, v in terms))
        if self.aggregation == "sum":
            return torch.cat(per_chunk, -1) / counts
        per_head = torch.cat(per_chunk, -1) / counts[:, :, None, None]
        return aggregate_heads(per_head, self.aggregation, blocks[:, 0] >= 0)

    def listed_copy(self, summaries, rows, counts):
        """aggregation "sum" only: [R, L, S, n * H * D] float32, the listed blocks' mean
        keys (then, with `variance`, their keys' variances) at `layer_rows` `rows`
        [R, L, S], divided by `counts` once here instead of at every re-ranking; None where
        the copy would take more than one read chunk (`read_limit`; Llama-3.1-8B's default
        shortlist of 988 blocks per layer: 259 MB per request), as the chunked reads are
        bounded.
        Memory: within the selection's scratch (engine/buffers.py
        `selection_scratch_bytes`); made with one store's rows at a time."""
        if self.aggregation != "sum":
            return None
        stores = [summaries.sums, *([summaries.deviations()] if self.variance else [])]
        width = summaries.num_kv_heads * summaries.head_dim
        if len(stores) * rows.numel() * width * 4 > read_limit(summaries):
            return None
        copy = torch.empty(*rows.shape, len(stores), width, dtype=torch.float32,
                           device=rows.device)
        flat = rows.flatten()
        for i, store in enumerate(stores):
            picked = store.view(-1, width).index_select(0, flat)  # [R * L * S, H * D]
            copy[..., i, :].copy_(picked.view(*rows.shape, width))
            del picked  # freed before the next store's rows are read
        copy.div_(counts[..., None, None])
        return copy.flatten(3)

    @staticmethod
    def _copied_scores(q: Tensor, copy: Tensor) -> Tensor:
        """q [R, L, H, G, D] (scaled) and a `listed_copy` [R, L, S, n * H * D] -> [R, L, S]:
        q . mean key (+ 1/2 q^2 . key variance), summed over each group's query heads."""
        weights = q.sum(3).flatten(2)  # [R, L, H * D]
        if copy.shape[-1] > weights.shape[-1]:  # the variances' weights follow
            weights = torch.cat([weights, q.square().sum(3).flatten(2).mul_(0.5)], -1)
        return rows_dot(weights, copy)

    def _use_all_blocks(self, summaries: BlockSummaries, ids: Tensor) -> bool:
        if self.strategy == "auto":
            return summaries.num_blocks <= 2 * ids.numel()
        return self.strategy == "all"

    def _summed_scores(self, q: Tensor, summaries: BlockSummaries, ids: Tensor,
                       store: Tensor) -> Tensor:
        """q [R, L, H*D] (summed over each group) -> [R, L, B]: q . (store / count) over
        H*D for each table block; store = the key sums (q . mean key) or deviations()
        (q . key variance). The "all" strategy reads the store by `score_chunks`."""
        num_layers, limit = store.shape[0], read_limit(summaries)
        counts = summaries.counts.clamp(min=1).float()
        if not self._use_all_blocks(summaries, ids):
            by_layer = q.transpose(0, 1)  # [L, R, H*D], as the gathered rows are ordered
            dots = torch.cat([rows_dot(by_layer, _gathered(store, ids[:, c]).flatten(3))
                              for c in gather_chunks(store, ids, limit)],
                             dim=-1).transpose(0, 1)
            return dots / counts[ids][:, None, :]
        rhs = q.permute(1, 2, 0)  # [L, H*D, R]
        dots = torch.cat([torch.bmm(store[:, chunk].float().flatten(2), rhs)
                          for chunk in score_chunks(store, limit)], dim=1)
        dots = dots / counts[:, None]  # [L, N, R]
        index = ids.t()[None].expand(num_layers, -1, -1)  # [L, B, R]
        return dots.gather(1, index).permute(2, 0, 1)  # [R, L, B]

    def _per_head_scores(self, q: Tensor, summaries: BlockSummaries, ids: Tensor,
                         store: Tensor) -> Tensor:
        """q [R, L, H, G, D] -> [R, L, H, G, B]: q . (store / count) per query head. The
        "all" strategy reads the store by `score_chunks`."""
        counts, limit = summaries.counts.clamp(min=1).float(), read_limit(summaries)
        if not self._use_all_blocks(summaries, ids):
            dots = torch.cat([torch.einsum("rlhgd,lrbhd->rlhgb", q, _gathered(store, ids[:, c]))
                              for c in gather_chunks(store, ids, limit)], dim=-1)
            return dots / counts[ids][:, None, None, None, :]
        dots = torch.cat([torch.einsum("rlhgd,lnhd->rlhgn", q, store[:, chunk].float())
                          for chunk in score_chunks(store, limit)], dim=-1) / counts
        return dots.gather(-1, ids[:, None, None, None, :].expand(*dots.shape[:4], -1))


class QuestPolicy(SelectionPolicy):
    """Quest page scoring: per query head h, bound(h, b) = sum_d max(q_d min_bd, q_d max_bd)
    / sqrt(d) >= q . k / sqrt(d) for every committed key k of block b (each channel's
    product is largest at one end of the channel's range), then one score per block by
    `aggregation`. Quest itself selects per head; one table per layer needs one score, and
    the default "softmax" (each head's bounds as a distribution over the blocks, summed)
    measured best over "max" and "sum" (`bench acceptance`, benchmarks/RESULTS.md). Reads
    2 key-sized vectors per block and layer (the mean-key policy reads one)."""
    name = "quest"

    def __init__(self, aggregation: str = "softmax", scale: float | None = None):
        _check_aggregation(aggregation)
        self.aggregation = aggregation
        self.scale = scale  # None: 1 / sqrt(head_dim)

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        per_head = torch.stack([self._layer_bounds(q[:, layer], summaries, block_table, layer)
                                for layer in range(q.shape[1])], dim=1)  # [R, L, H, G, B]
        candidates = full_block_mask(on_device(num_committed, q.device), summaries.block_size,
                                     block_table.shape[1])
        return aggregate_heads(per_head, self.aggregation, candidates)

    @staticmethod
    def _layer_bounds(q: Tensor, summaries: BlockSummaries, block_table: Tensor,
                      layer: int) -> Tensor:
        """q [R, H, G, D] of one layer -> [R, H, G, B] upper bounds of q . k per block
        (an empty block's bounds read as 0: it is never a candidate)."""
        lo, hi = summaries.bounds(layer, block_table)  # [R, B, H, D]
        return (torch.einsum("rhgd,rbhd->rhgb", q.clamp(min=0), hi)
                + torch.einsum("rhgd,rbhd->rhgb", q.clamp(max=0), lo))


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
        source lays them out (2x faster than one einsum over all heads on a CPU)."""
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


POLICIES: dict[str, type[SelectionPolicy]] = {
    cls.name: cls for cls in (RetrievalPolicy, QuestPolicy, StreamingLLMPolicy, H2OPolicy,
                              TopKOraclePolicy, RerankPolicy)
}


def make_policy(name: str, **kwargs) -> SelectionPolicy:
    """The policy registered under `name`, constructed with kwargs."""
    if name not in POLICIES:
        raise ValueError(f"unknown selection policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
