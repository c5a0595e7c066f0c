"""The policies that never read a key: they score blocks from the per-block summaries
(`summaries.py`) or, streamingllm, from the blocks' positions alone.

  streamingllm  sinks + the most recent blocks (the score is the block index).
  retrieval     TriForce: query . mean post-RoPE key of the block, per query head,
                aggregated over the query heads of each KV group and over KV heads;
                with `variance`, plus 1/2 sum_d q_d^2 var_d (the keys' per-channel
                variance in the block): a second-order estimate of log E[exp(q . k)].
                Re-ranks a shortlist between middle rounds (`shortlist_scores`).
  quest         Quest (Tang et al. 2024): per query head, the upper bound
                sum_d max(q_d min_d, q_d max_d) of q . k over the block's keys, from
                per-channel key bounds; aggregated over the layer's query heads.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from vllm_triforce.core.blocks import full_block_mask
from vllm_triforce.core.compiled import first_line
from vllm_triforce.core.fused_reads import CompiledScores
from vllm_triforce.core.reads import (block_slice, flat_rows, gather_chunks, gathered,
                                      read_limit, rows_dot, score_chunks)
from vllm_triforce.core.scoring import (SelectionPolicy, aggregate_heads, check_aggregation,
                                        group_query)
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.tensors import on_device

logger = logging.getLogger(__name__)


class StreamingLLMPolicy(SelectionPolicy):
    """Sinks + a contiguous recent window: the most recent candidates win."""
    name = "streamingllm"

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        num_reqs, num_layers = query.shape[:2]
        order = torch.arange(block_table.shape[1], device=block_table.device, dtype=torch.float32)
        return order.expand(num_reqs, num_layers, -1).clone()


class RetrievalPolicy(SelectionPolicy):
    """TriForce retrieval: q . mean_key / sqrt(d), aggregated to one score per block.

    aggregation="sum" (default) sums the raw scaled dot products over the query heads
    of a group and over KV heads. It is the reference code's score (TriForce, MHA) and
    the one the engine uses (`bench acceptance` compares the aggregations); being linear in
    q it is one dot product with the group-summed query, the cheapest option.
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
    A compact variance (BlockSummaries(compact_variance=True): per band of channels) is
    weighed by each band's mean q_d^2 (`BlockSummaries.variance_weights`). Coded summaries
    (BlockSummaries(coded=True), the engine's default) are read back as float32 chunk by
    chunk (core/reads.py) and scored as float ones holding the same values.
    """
    name = "retrieval"

    def __init__(self, aggregation: str = "sum", strategy: str = "auto",
                 scale: float | None = None, variance: bool = False):
        check_aggregation(aggregation)
        self.variance = variance
        self.needs_variance = variance
        if strategy not in ("auto", "gather", "all"):
            raise ValueError(f"strategy must be 'auto', 'gather' or 'all', not {strategy!r}")
        self.aggregation = aggregation
        self.strategy = strategy
        self.scale = scale  # None: 1 / sqrt(head_dim)
        # core/fused_reads.CompiledScores over the engine's coded summaries
        # (`compiled_selection`): block scores in one compiled kernel, no listed copy
        self.compiled: CompiledScores | None = None

    def block_scores(self, query, summaries, block_table, num_committed, state=None,
                     candidates: Tensor | None = None):
        """candidates [R, max_blocks] bool optionally restricts the softmax domain."""
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        ids = on_device(block_table, summaries.device, torch.long).clamp(min=0)  # [R, B]
        if self._compiled_for(summaries):  # every table block as a listed one: one kernel
            scores = self._compiled_scores(q, summaries, ids,
                                           summaries.counts[ids].clamp(min=1).float())
            if scores is not None:
                return scores
        if self.aggregation == "sum":  # linear in q: one dot product per KV group
            scores = self._summed_scores(q.sum(3).flatten(2), summaries, ids, summaries.sums)
            if self.variance:
                weights = summaries.variance_weights(q.square().sum(3)).flatten(2)
                scores += 0.5 * self._summed_scores(weights, summaries, ids,
                                                    summaries.deviations())
            return scores
        per_head = self._per_head_scores(q, summaries, ids, summaries.sums)  # [R, L, H, G, B]
        if self.variance:
            per_head += 0.5 * self._per_head_scores(summaries.variance_weights(q.square()),
                                                    summaries, ids, summaries.deviations())
        if candidates is None:
            candidates = full_block_mask(on_device(num_committed, q.device), summaries.block_size,
                                         block_table.shape[1])
        return aggregate_heads(per_head, self.aggregation, candidates)

    def shortlist_scores(self, query, summaries, blocks, rows=None, counts=None, copy=None):
        """As block_scores, over per-layer block lists (softmax: over the listed blocks),
        read by `gather_chunks`: Llama-3.1-8B's default shortlist (4 x 247 blocks per layer)
        at batch 8 would otherwise gather 2 GiB of float32 rows per re-selection. With
        `copy` (`listed_copy`), read from it: one or two batched products, no store read.
        With `compiled` (over these summaries), its kernel reads the store: one launch."""
        q = group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q * (self.scale or 1.0 / math.sqrt(q.shape[-1]))
        if copy is not None:
            return self._copied_scores(q, copy, summaries)
        if counts is None:
            counts = summaries.counts[blocks.clamp(min=0)].clamp(min=1).float()  # [R, L, S]
        if rows is None:
            rows = summaries.layer_rows(blocks)  # one index for every store read
        weights = [(q, summaries.sums)]
        if self.variance:
            weights.append((0.5 * summaries.variance_weights(q.square()),
                            summaries.deviations()))
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
        """aggregation "sum" only: [R, L, S, H * D (+ H * W)] float32, the listed blocks'
        mean keys (then, with `variance`, their keys' variances) at `layer_rows` `rows`
        [R, L, S], divided by `counts` once here instead of at every re-ranking; None where
        the copy would take more than one read chunk (`read_limit`; Llama-3.1-8B's default
        shortlist of 988 blocks per layer: 259 MB per request), as the chunked reads are
        bounded, or where `compiled` reads the store itself.
        Memory: within the selection's scratch (engine/buffers.py
        `selection_scratch_bytes`); made with one store's rows at a time."""
        if self.aggregation != "sum" or self._compiled_for(summaries):
            return None
        stores = [summaries.sums, *([summaries.deviations()] if self.variance else [])]
        widths = [math.prod(store.shape[2:]) for store in stores]  # H * D, then H * W
        if sum(widths) * rows.numel() * 4 > read_limit(summaries):
            return None
        copy = torch.empty(*rows.shape, sum(widths), dtype=torch.float32, device=rows.device)
        flat, start = rows.flatten(), 0
        for store, width in zip(stores, widths):
            picked = flat_rows(store, flat)  # [R * L * S, width]
            copy[..., start:start + width].copy_(picked.view(*rows.shape, width))
            start += width
            del picked  # freed before the next store's rows are read
        return copy.div_(counts[..., None])

    def table_selection(self, query, summaries, block_table, num_committed, shortlist_size):
        """`compiled` over these summaries: a step's selection, query to selection and
        shortlist (`shortlist_size` blocks a layer: 0, none; else the size it was built
        for), in one compiled graph (core/fused_reads.table_choice); None without it,
        where it did not compile, or where it failed (`_dropped`)."""
        if (not self._compiled_for(summaries) or self.compiled.shortlist_size is None
                or self.compiled.table_failed is not None
                or shortlist_size not in (0, self.compiled.shortlist_size)):
            return None
        try:
            return self.compiled.choose_table(query, block_table, num_committed,
                                              shortlist_size)
        except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
            return self._dropped(exc)

    def listed_selection(self, query, summaries, shortlist):
        """`compiled` over these summaries: the shortlist's re-ranking, query to selection,
        in one compiled graph (core/fused_reads.listed_choice); None without it, or where
        it failed (`_dropped`)."""
        if not self._compiled_for(summaries):
            return None
        try:
            return self.compiled.choose_listed(query, shortlist)
        except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
            return self._dropped(exc)

    def _compiled_for(self, summaries) -> bool:
        return (self.compiled is not None and self.compiled.summaries is summaries
                and self.aggregation == "sum")

    def _compiled_scores(self, q: Tensor, summaries: BlockSummaries, ids: Tensor,
                         counts: Tensor) -> Tensor | None:
        """q [R, L, H, G, D] (scaled) -> [R, L, B] by `compiled`: q . mean key (+ 1/2 q^2
        . key variance), summed over each group's query heads, of every layer's blocks ids
        [R, B] (physical) with their counts [R, B]. None where the kernel failed
        (`_dropped`)."""
        weights = [q.sum(3)]  # [R, L, H, D]
        if self.variance:
            weights.append(summaries.variance_weights(q.square().sum(3)).mul_(0.5))
        try:
            return self.compiled.tables(ids, counts, weights)
        except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
            return self._dropped(exc)

    def _dropped(self, exc: Exception) -> None:
        """A compiled kernel failed (it would have compiled again, say): the kernels are
        dropped, with a warning, and the caller reads eagerly from then on."""
        logger.warning("TriForce compiled_selection: the compiled block scores failed "
                       "(%s: %s); block scores read the summaries eagerly from now on.",
                       type(exc).__name__, first_line(exc))
        self.compiled = None
        return None

    @staticmethod
    def _copied_scores(q: Tensor, copy: Tensor, summaries: BlockSummaries) -> Tensor:
        """q [R, L, H, G, D] (scaled) and a `listed_copy` [R, L, S, H * D (+ H * W)] ->
        [R, L, S]: q . mean key (+ 1/2 q^2 . key variance), summed over each group's query
        heads."""
        weights = q.sum(3).flatten(2)  # [R, L, H * D]
        if copy.shape[-1] > weights.shape[-1]:  # the variances' weights follow
            squares = summaries.variance_weights(q.square().sum(3)).flatten(2)  # [R, L, H * W]
            weights = torch.cat([weights, squares.mul_(0.5)], -1)
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
            dots = torch.cat([rows_dot(by_layer, gathered(store, ids[:, c]).flatten(3))
                              for c in gather_chunks(store, ids, limit)],
                             dim=-1).transpose(0, 1)
            return dots / counts[ids][:, None, :]
        rhs = q.permute(1, 2, 0)  # [L, H*D, R]
        dots = torch.cat([torch.bmm(block_slice(store, chunk).flatten(2), rhs)
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
            dots = torch.cat([torch.einsum("rlhgd,lrbhd->rlhgb", q, gathered(store, ids[:, c]))
                              for c in gather_chunks(store, ids, limit)], dim=-1)
            return dots / counts[ids][:, None, None, None, :]
        dots = torch.cat([torch.einsum("rlhgd,lnhd->rlhgn", q, block_slice(store, chunk))
                          for chunk in score_chunks(store, limit)], dim=-1) / counts
        return dots.gather(-1, ids[:, None, None, None, :].expand(*dots.shape[:4], -1))


class QuestPolicy(SelectionPolicy):
    """Quest page scoring: per query head h, bound(h, b) = sum_d max(q_d min_bd, q_d max_bd)
    / sqrt(d) >= q . k / sqrt(d) for every committed key k of block b (each channel's
    product is largest at one end of the channel's range), then one score per block by
    `aggregation`. Quest itself selects per head; one table per layer needs one score, and
    the default "softmax" (each head's bounds as a distribution over the blocks, summed)
    lets every head spend the same unit of mass, where "sum" lets the heads of large
    bounds decide and "max" one head alone (`bench acceptance` compares the three). Reads
    2 key-sized vectors per block and layer (the mean-key policy reads one)."""
    name = "quest"

    def __init__(self, aggregation: str = "softmax", scale: float | None = None):
        check_aggregation(aggregation)
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
