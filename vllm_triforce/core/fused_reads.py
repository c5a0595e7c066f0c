"""Block scores read from coded summaries in one compiled kernel (`compiled_selection`,
config.py).

The retrieval policy scores blocks at each step's selection (every block of a request's
table) and between middle rounds (each layer's shortlist): for every block, q . mean key
(+ 1/2 q^2 . key variance) over its KV heads' channels, from summaries coded in one byte a
value (core/summary_coding.py). Both are rows of the stores viewed as [L * N, H, D]
(`BlockSummaries.layer_rows`), [R, L, S] of them. Read in eager torch, the
codes are gathered and decoded to float32 in chunks of at most one read chunk
(core/reads.py) and multiplied chunk by chunk: at Llama-3.1-8B's shape (8 requests,
32 layers, 988 listed blocks, 8 x 128 channels) 1 GiB of float32 a store in 16 chunks,
some 25 host operations a chunk, every round of a shortlist's re-ranking. Compiled (torch.compile, inductor), the
gather, the decode (a 256-entry table, `summary_coding.decode_table`), the products and
the sums over channels are one kernel that allocates nothing larger than its result
[R, L, S]: a launch or two a round, whatever the shape. Between middle rounds the whole
re-ranking is one compiled graph (`listed_choice`): the query's weights, the scores, the
top-k and the selection in order, where eager torch dispatches some 25 operations more.

The requests and listed-blocks axes are marked unbacked (dynamo's `mark_unbacked`), so
one compilation serves every batch, table and shortlist size, 1 included: a size never
seen compiles nothing. The first call compiles (about 10 s on a CPU); the engine makes it
at start-up (`CompiledScores.warm_up`), and a compilation that fails there leaves the
scores to the eager reads, with a warning.

Example (tests/core/test_core_fused_reads.py): a store of 4 rows, one layer, one KV head,
two channels, coded "fp8" from [1, -2], [0.5, 0.5], [4, 0], [0, 3]; rows [[0, 1, 3]] with
weights [1, 1] and counts [1, 2, 1] score [-1, 0.5, 3] (row 1: (0.5 + 0.5) / 2).
"""

from __future__ import annotations

import functools
import math
import time

import torch
from torch import Tensor
from torch._dynamo.decorators import mark_static, mark_unbacked

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.blocks import PAD
from vllm_triforce.core.compiled import CompiledFunction, dense, first_line, inference
from vllm_triforce.core.selection import (Choice, Frame, Selection, Shortlist, ordered_blocks,
                                          rank_listed, rank_table)
from vllm_triforce.core.summaries import fold_bands
from vllm_triforce.core.summary_coding import CodedStore, decode_table
from vllm_triforce.core.tensors import on_device


def listed_dots(rows: Tensor, counts: Tensor, weights: Tensor, codes: Tensor,
                scales: Tensor, table: Tensor, more_weights: Tensor | None = None,
                more_codes: Tensor | None = None, more_scales: Tensor | None = None,
                more_table: Tensor | None = None) -> Tensor:
    """rows [R, L, S] of the stores viewed as [L * N, H, D]; counts [R, L, S] float32;
    weights [R, L, H, D] float32 for the store `codes` [L * N, H, D] uint8 with `scales`
    [L * N, H, 1] and decode `table` [256]; optionally a second store (the key variance)
    and its weights -> [R, L, S] float32: sum over H and D of weights x decoded rows, over
    counts. Eager, it holds the decoded rows ([R, L, S, H, D] float32): for tests and small
    shapes; compiled (`CompiledScores`), one kernel."""
    decoded = table[codes[rows].long()] * scales[rows]  # [R, L, S, H, D]
    dots = (decoded * weights[:, :, None]).sum((-1, -2))
    if more_codes is not None:
        decoded = more_table[more_codes[rows].long()] * more_scales[rows]
        dots = dots + (decoded * more_weights[:, :, None]).sum((-1, -2))
    return dots / counts


def table_dots(ids: Tensor, counts: Tensor, num_blocks: int, weights: Tensor, *stores):
    """`listed_dots` of every layer's rows of the blocks ids [R, B] (physical, >= 0), with
    their counts [R, B] float32: a step's selection's scores [R, L, B]. The rows are
    worked out inside (layer l's block b: row l * num_blocks + b), so that, compiled, the
    kernel holds nothing of size [R, L, B] but the scores."""
    layers = torch.arange(weights.shape[1], device=ids.device)[None, :, None]
    return listed_dots(layers * num_blocks + ids[:, None, :], counts[:, None, :], weights,
                       *stores)


def listed_choice(query: Tensor, shares: Tensor | None, rows: Tensor, counts: Tensor,
                  padding: Tensor, logical: Tensor, num_chosen: Tensor, sink_ids: Tensor,
                  codes: Tensor, scales: Tensor, table: Tensor, more_codes: Tensor | None = None,
                  more_scales: Tensor | None = None, more_table: Tensor | None = None, *,
                  scale: float, num_kv_heads: int, variance_width: int, k: int,
                  max_selected: int) -> Tensor:
    """A shortlist's re-ranking from the query to the selection, as `Selector.choose` with
    a shortlist makes it eagerly (`RetrievalPolicy.shortlist_scores`, then
    `select_listed`): query [L, R, Hq, D] (each request's newest token, layer-major as a
    round's query buffers hold it: engine/device/capture.LayerRows); shares [L, H, D]
    the key variance's channel shares (`BlockSummaries.variance_shares`; None: the
    variance is kept per channel); a `Shortlist`'s rows, counts, padding and logical
    blocks [R, L, S] (S >= k) and its Frame's num_chosen [R, 1, 1] and sink_ids [R, 1,
    sinks]; the stores as `listed_dots` takes them (the second: the key variance) ->
    [R, L, max_selected] logical blocks (Selection.logical_blocks). k is
    `BlockCounts.max_chosen`, the candidates a selection ranks."""
    weights, more_weights = query_weights(query.transpose(0, 1), shares, scale=scale,
                                          num_kv_heads=num_kv_heads,
                                          variance_width=variance_width,
                                          variance=more_codes is not None)
    scores = listed_dots(rows, counts, weights, codes, scales, table, more_weights,
                         more_codes, more_scales, more_table)
    torch._check(scores.shape[-1] >= k)  # the caller pads a shorter list
    kept = torch.arange(k, device=query.device) < num_chosen  # `Frame.kept`
    return ordered_blocks(rank_listed(scores, padding, logical, k), kept, sink_ids,
                          max_selected)


def query_weights(query: Tensor, shares: Tensor | None, *, scale: float, num_kv_heads: int,
                  variance_width: int, variance: bool) -> tuple[Tensor, Tensor | None]:
    """query [R, L, Hq, D] -> the stores' weights (`listed_dots`): q summed over each KV
    head's query heads [R, L, H, D], and with the key variance 1/2 q^2 folded to the
    store's bands [R, L, H, W] (None without); q scaled by `scale`. shares as
    `listed_choice` takes them."""
    num_reqs, num_layers, num_q_heads, head_dim = query.shape
    q = query.float().reshape(num_reqs, num_layers, num_kv_heads, num_q_heads // num_kv_heads,
                              head_dim) * scale
    if not variance:
        return q.sum(3), None
    squares = q.square().sum(3)  # 1/2 q^2 per channel, folded to the store's bands
    return q.sum(3), 0.5 * fold_bands(squares if shares is None else squares * shares,
                                      variance_width)


def table_choice(query: Tensor, shares: Tensor | None, table: Tensor, committed: Tensor,
                 block_counts: Tensor, codes: Tensor, scales: Tensor, decode: Tensor,
                 more_codes: Tensor | None = None, more_scales: Tensor | None = None,
                 more_table: Tensor | None = None, *, scale: float, num_kv_heads: int,
                 variance_width: int, blocks: BlockCounts, num_blocks: int,
                 shortlist_size: int) -> tuple[Tensor, ...]:
    """A step's selection from the query to the selection and its shortlist, as
    `Selector.choose(keep_shortlist=True)` makes it with the compiled scores
    (`RetrievalPolicy.block_scores`, `select_blocks`, `best_candidates`, `Shortlist.of`
    and its `summary_rows`): query [R, L, Hq, D] (each request's newest token); table
    [R, B] int64 physical ids, -1 padded, B >= max(max_chosen, shortlist_size);
    committed [R] int64; block_counts [N] the summaries' token counts; the stores as
    `listed_dots` takes them -> `rank_table`'s tensors, then (shortlist_size > 0) the
    shortlist's summary rows and counts [R, L, shortlist_size]."""
    weights, more_weights = query_weights(query, shares, scale=scale,
                                          num_kv_heads=num_kv_heads,
                                          variance_width=variance_width,
                                          variance=more_codes is not None)
    ids = table.clamp(min=0)
    scores = table_dots(ids, block_counts[ids].clamp(min=1).float(), num_blocks, weights, codes,
                        scales, decode, more_weights, more_codes, more_scales, more_table)
    torch._check(scores.shape[-1] >= max(blocks.max_chosen, shortlist_size))  # the caller pads
    out = rank_table(scores, table, committed, blocks, shortlist_size)
    if shortlist_size == 0:
        return out
    physical = out[4].clamp(min=0)  # `BlockSummaries.layer_rows`, and their counts
    layers = torch.arange(query.shape[1], device=table.device)[None, :, None]
    return out + (layers * num_blocks + physical, block_counts[physical].clamp(min=1).float())


class CompiledScores:
    """Compiled over one summaries' coded stores (`sums`, and with the key variance
    `deviations()`), built once per engine: `tables` scores a step's tables
    (`table_dots`); `choose_table` makes a step's selection and its shortlist of
    `shortlist_size` blocks a layer (0: none), query to both (`table_choice`; None: no
    such graph, for a caller that scores and ranks itself);
    `choose_listed` re-ranks a shortlist between middle rounds, query to selection
    (`listed_choice`); for the geometry `blocks`, queries of `num_q_heads` heads and the
    policy's `scale` (None: 1 / sqrt(head_dim))."""

    def __init__(self, summaries, variance: bool, blocks: BlockCounts, num_q_heads: int,
                 scale: float | None = None, shortlist_size: int | None = None):
        self.summaries = summaries
        self.blocks = blocks
        self.num_q_heads = num_q_heads
        stores = [summaries.sums, *([summaries.deviations()] if variance else [])]
        if not all(isinstance(s, CodedStore) for s in stores):
            raise ValueError("CompiledScores reads coded summaries (compact_summaries)")
        self._stores = [(flat(s.codes), flat(s.scales), decode_table(s.coding, s.device))
                        for s in stores]
        self._choice = functools.partial(
            listed_choice, scale=scale or 1.0 / math.sqrt(summaries.head_dim),
            num_kv_heads=summaries.num_kv_heads, variance_width=summaries.variance_width,
            k=blocks.max_chosen, max_selected=blocks.max_selected)
        self._listed = CompiledFunction(self._choice)
        self._tables = CompiledFunction(table_dots)
        self.shortlist_size = shortlist_size
        self._table = CompiledFunction(table_choice)  # its constants: `_table_constants`
        # why `table_choice` did not compile at the warm-up (None: it did, or none ran):
        # then a step's selection scores with `tables` and ranks eagerly
        self.table_failed: str | None = None
        self.compile_seconds: float | None = None  # set by warm_up

    def tables(self, ids: Tensor, counts: Tensor, weights: list[Tensor],
               compile_now: bool = False) -> Tensor:
        """ids, counts [R, B] (physical blocks >= 0, their token counts); weights: one
        [R, L, H, D] float32 per store -> scores [R, L, B]."""
        ids, counts = inference(ids), inference(counts.float())
        weights = [inference(w.float().contiguous()) for w in weights]
        if compile_now:
            for t in (ids, counts, *weights):
                mark_unbacked(t, 0)  # requests
            for t in (ids, counts):
                mark_unbacked(t, 1)  # the tables' width
        return self._tables(ids, counts, self.summaries.num_blocks,
                            *self._with_stores(weights), compile_now=compile_now)

    def choose_table(self, query: Tensor, block_table: Tensor, num_committed: Tensor,
                     shortlist_size: int, compile_now: bool = False) -> Choice:
        """query [R, L, Hq, D], block_table [R, B] physical ids, num_committed [R] -> the
        step's Choice: its Selection and (shortlist_size, 0 or this object's) its
        Shortlist, summary rows read, as `Selector.choose` makes them eagerly. A table
        narrower than max(max_chosen, shortlist_size) is padded with -1 here (no candidate:
        the selection is the same), and the shortlist cut back to the table's width."""
        device = self.summaries.device
        width, size = block_table.shape[1], self.shortlist_size
        table = on_device(block_table, device, torch.long)
        least = max(self.blocks.max_chosen, size)
        if width < least:
            table = torch.nn.functional.pad(table, (0, least - width), value=PAD)
        table = inference(dense(table))
        committed = inference(dense(on_device(num_committed, device, torch.long)))
        query = inference(dense(query.float()))
        if compile_now:
            for t in (query, table, committed):
                mark_unbacked(t, 0)  # requests
            mark_unbacked(table, 1)  # the tables' width
            for dim in (1, 2, 3):  # layers, heads, channels: the model's
                mark_static(query, dim)
        shares = self.summaries.variance_shares() if len(self._stores) > 1 else None
        out = self._table(query, shares, table, committed, self.summaries.counts,
                          *self._with_stores(), compile_now=compile_now,
                          **self._table_constants)
        selection = Selection(*out[:3])
        if shortlist_size == 0 or size == 0:
            return Choice(selection)
        logical, physical, num_chosen, sink_ids, rows, counts = out[3:]
        if width < size:  # as `best_candidates` lists a narrow table: its width
            logical, physical, rows, counts = (t[..., :width] for t in
                                               (logical, physical, rows, counts))
        return Choice(selection, Shortlist(
            logical, physical, Frame(num_chosen, sink_ids, selection.num_selected,
                                     selection.tail_start),
            rows=rows, counts=counts, padding=logical < 0))

    @functools.cached_property
    def _table_constants(self) -> dict:
        """`table_choice`'s keyword arguments."""
        s = self.summaries
        return dict(scale=self._choice.keywords["scale"], num_kv_heads=s.num_kv_heads,
                    variance_width=s.variance_width, blocks=self.blocks,
                    num_blocks=s.num_blocks, shortlist_size=self.shortlist_size)

    def choose_listed(self, query: Tensor, shortlist, compile_now: bool = False) -> Tensor:
        """query [R, L, Hq, D]; `shortlist` (core/selection.Shortlist, its summary rows
        read) -> its Selection's logical blocks [R, L, max_selected]. A list shorter than
        max_chosen (a table of fewer blocks) is padded to it here: padding ranks last and
        is never kept, so the selection is the same."""
        k = self.blocks.max_chosen
        listed = [shortlist.rows, shortlist.counts, shortlist.padding, shortlist.logical]
        short = k - listed[0].shape[-1]
        if short > 0:
            listed = [torch.nn.functional.pad(t, (0, short), value=fill)
                      for t, fill in zip(listed, (0, 1.0, True, -1))]
        frame = shortlist.frame
        # float32, layer-major and dense, as at warm_up: at most a copy (none of a round's
        # queries in a bf16 model, held layer-major: engine/device/capture)
        query = inference(dense(query.float().transpose(0, 1)))
        listed = [inference(dense(t)) for t in listed]
        kept = [inference(dense(frame.num_chosen)), inference(dense(frame.sink_ids))]
        if compile_now:
            mark_unbacked(query, 1)  # requests
            for t in (*listed, *kept):
                mark_unbacked(t, 0)  # requests
            for t in listed:
                mark_unbacked(t, 2)  # listed blocks
            for dim in (0, 2, 3):  # layers, heads, channels: the model's
                mark_static(query, dim)
        shares = self.summaries.variance_shares() if len(self._stores) > 1 else None
        return self._listed(query, shares, *listed, *kept, *self._with_stores(),
                            compile_now=compile_now)

    def _with_stores(self, weights: list[Tensor] | None = None) -> tuple:
        """The stores' arguments (each store's weights first, where given)."""
        args = ()
        for i, store in enumerate(self._stores):
            args += ((weights[i],) if weights is not None else ()) + store
        return args

    def warm_up(self) -> float:
        """Compile the three forms now (2 requests; a table of 3 blocks, a list of
        max_chosen + 1, a step's table one block wider than it pads to; block 0
        throughout; the last not where `shortlist_size` is None): the seconds it took.
        Where the step's whole selection does not compile (`table_failed` says why), the
        other two still serve."""
        s, k = self.summaries, self.blocks.max_chosen
        start = time.perf_counter()
        try:
            if self.shortlist_size is not None:
                width = max(k, self.shortlist_size) + 1
                self.choose_table(
                    torch.zeros(2, s.num_layers, self.num_q_heads, s.head_dim,
                                device=s.device),
                    torch.zeros(2, width, dtype=torch.long, device=s.device),
                    torch.full((2,), width * s.block_size, dtype=torch.long, device=s.device),
                    self.shortlist_size, compile_now=True)
        except Exception as exc:  # noqa: BLE001 - inductor's failures are many kinds
            # the step's selection takes the compiled scores, then ranks eagerly
            self.table_failed = f"{type(exc).__name__}: {first_line(exc)}"
        weights = [torch.zeros(2, s.num_layers, s.num_kv_heads, codes.shape[-1],
                               device=s.device) for codes, _, _ in self._stores]
        self.tables(torch.zeros(2, 3, dtype=torch.long, device=s.device),
                    torch.ones(2, 3, device=s.device), weights, compile_now=True)
        # a new tensor for each argument: dynamo guards that arguments alias where they did
        def listed() -> Tensor:
            return torch.zeros(2, s.num_layers, k + 1, dtype=torch.long, device=s.device)

        self.choose_listed(
            torch.zeros(2, s.num_layers, self.num_q_heads, s.head_dim, device=s.device),
            Shortlist(listed(), listed(), Frame(
                torch.ones(2, 1, 1, dtype=torch.long, device=s.device),
                torch.zeros(2, 1, self.blocks.retrieval_sink_blocks, dtype=torch.long,
                            device=s.device), None, None),
                rows=listed(), counts=torch.ones(2, s.num_layers, k + 1, device=s.device),
                padding=listed() < 0), compile_now=True)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


def flat(store_part: Tensor) -> Tensor:
    """[L, N, H, X] -> [L * N, H, X], a view (rows as `BlockSummaries.layer_rows` number
    them)."""
    return store_part.view(store_part.shape[0] * store_part.shape[1], *store_part.shape[2:])
