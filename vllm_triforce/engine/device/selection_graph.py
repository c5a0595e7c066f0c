"""A middle round's re-selection and the next round's load as one graph per token bucket
(`selection_graphs`, with `round_graphs` and `compiled_selection`; ROUND_GRAPHS.md P3).

Why. With the middle passes replayed as CUDA graphs (round_graph.py), what is left
between two replays is host work: at Llama-3.1-8B's width on an H200, 3.4 ms a round
against 1.71 ms of replays (benchmarks/gpu/round_graph_2026-11-30/), 1.29 ms of it the
launches of the compiled re-ranking and pass layout, most of the rest some 80 small
launches around them. Where a round emits one token per request (two levels, or the
small draft sitting out) and every request still drafting re-selects from this step's
shortlist (`refresh_interval` 1, the default; a drafting request that will re-select
between rounds re-selects at the step's start too, and so holds it:
retrieval_level.RetrievalStep.select), what follows the round on the device is the same
every round:
- each request's newest query gathered from the round's query buffers;
- its shortlist re-ranked (the compiled `listed_choice`, core/fused_reads.py);
- the next pass's per-layer tables and KV slots laid out of that selection (PassLayout);
- the next pass's ids, positions, query starts and lengths written into the round buffers.
Here that is one closure over persistent buffers per bucket (`closure`), captured as one
CUDA graph on a GPU and run eagerly over the same buffers on a CPU: the twin the tests
hold to today's path (`select_in_middle`, then `load_ahead`). A step's first middle pass
runs over the selection the step's start made (`load_selected`): the same closure
without the re-ranking, a second graph per bucket, in place of `load_runs` and its
compiled layout's launch.

Per round the host works out what it knows (positions, query rows, the tables' sizes:
core/tables.TableLayout), packs it into one array padded to the bucket and copies it
into `staged` in one non-blocking copy; copies the round's tokens into `tokens` (a part
of `staged`, where `load_selected` stages the host's ids instead); runs
the bucket; and records the selection in the level's SelectionTable (one indexed write).
The shortlist's tensors go into the listed buffers when a step first re-ranks it (or a
subset of it), the requests' block tables when the rows change: not every round.

Padding. Padded requests have query row 0, no selected block and no tail (their staged
sizes are 0) and sequence length 0; padded tokens id 0, position 0 and slot -1 (`valid`
0). What an earlier, larger round left in the listed buffers' padded rows is re-ranked
and thrown away: valid indices, never read.

What takes today's path: a round in which some request is not due or does not hold this
step's shortlist, fp8 queries, the compiled re-ranking dropped, a block table wider than
`max_blocks`, or a pass that fits no bucket (`SelectionGraphs.load` returns None).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_triforce.core.compiled import first_line
from vllm_triforce.core.selection import Frame, Shortlist
from vllm_triforce.core.tables import TableLayout
from vllm_triforce.engine.buffers import (SELECTION_REQUEST_FIELDS, SELECTION_TOKEN_FIELDS,
                                          selection_staged_length)
from vllm_triforce.engine.device.round_graph import PADDING_SLOT, LoadedPass, pool_bytes

logger = logging.getLogger(__name__)


class SelectionGraphs:
    """The fused re-selection and load of a middle round (module docstring) for the
    middle level's `graphs` (round_graph.RoundGraphs: its buffers, bounds and query
    buffers), re-ranking with `compiled` (core/fused_reads.CompiledScores) shortlists of
    at most `listed` blocks a layer, for queries of `num_heads` x `head_size` and block
    tables of at most `max_blocks` blocks."""

    def __init__(self, graphs, compiled, num_heads: int, head_size: int, listed: int,
                 max_blocks: int, device, use_cuda_graphs: bool):
        self.graphs, self.compiled = graphs, compiled
        bounds = graphs.bounds
        self.bounds = bounds
        self.num_heads, self.head_size = num_heads, head_size
        blocks = compiled.blocks
        reqs, tokens, layers = bounds.max_requests, bounds.max_tokens, len(graphs.layer_names)
        listed = max(listed, blocks.max_chosen)  # `choose_listed` pads shorter lists to it
        self.max_blocks = max_blocks
        staged = selection_staged_length(tokens, reqs)

        def full(shape, fill, dtype) -> torch.Tensor:
            with torch.inference_mode():  # as the engine's tensors (dynamo guards on it)
                return torch.full(shape, fill, dtype=dtype, device=device)

        # a Shortlist's tensors, `listed` blocks a layer: [R, L, S]; its Frame's [R, 1, *]
        self.logical = full((reqs, layers, listed), -1, torch.long)
        self.summary_rows = full((reqs, layers, listed), 0, torch.long)
        self.counts = full((reqs, layers, listed), 1.0, torch.float32)
        self.padding = full((reqs, layers, listed), True, torch.bool)
        self.num_chosen = full((reqs, 1, 1), 0, torch.long)
        self.sink_ids = full((reqs, 1, blocks.retrieval_sink_blocks), -1, torch.long)
        self.block_table = full((reqs, max_blocks), 0, torch.int32)  # the rows' tables
        self.selected = full((reqs, layers, blocks.max_selected), -1, torch.int32)
        self.staged = full((staged,), 0, torch.long)  # the host's values (`load`)
        self.views = _staged_views(self.staged, tokens, reqs)
        # the pass's token ids: the round's (`load` copies them in after the staged
        # values), or the host's, staged (`load_selected`)
        self.tokens = self.views["tokens"]
        # the host's side of `staged`, written each round (its copy to the device is made
        # from a pinned copy of it, so it can be written again at once)
        self.host = np.zeros(staged, dtype=np.int64)
        self.host_views = _staged_views(self.host, tokens, reqs)
        self.use_cuda_graphs = use_cuda_graphs
        # (bucket, whether it re-ranks) -> its run: its closure, or its CUDA graph's replay
        self.runs: dict = {}
        self._pool = None
        self.failed: str | None = None  # why the graphs were given up (then today's path)
        self._shortlists: dict[int, Shortlist] = {}
        self.query_buffer: torch.Tensor | None = None  # the round's queries [L, T, Hq * D]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.logical, self.summary_rows, self.counts,
                                      self.padding, self.num_chosen, self.sink_ids,
                                      self.block_table, self.selected, self.staged))

    def pool_bytes(self) -> int:
        """What the graphs' private pool holds (0: none captured)."""
        return pool_bytes(self._pool)

    # ---- what changes per step, not per round ------------------------------------------
    def set_listed(self, shortlist: Shortlist, summaries) -> None:
        """The due requests' shortlist (its rows in their order) into the listed buffers,
        padded to `listed` blocks a layer: padding ranks last and is never kept."""
        rows, counts = shortlist.summary_rows(summaries)
        if shortlist.padding is None:
            shortlist.padding = shortlist.logical < 0
        n, s = shortlist.logical.shape[0], shortlist.logical.shape[-1]
        for buffer, part, fill in ((self.logical, shortlist.logical, -1),
                                   (self.summary_rows, rows, 0), (self.counts, counts, 1.0),
                                   (self.padding, shortlist.padding, True)):
            buffer[:n, :, :s].copy_(part)
            if s < buffer.shape[-1]:  # a shortlist of a table narrower than the buffers
                buffer[:n, :, s:].fill_(fill)
        self.num_chosen[:n].copy_(shortlist.frame.num_chosen)
        self.sink_ids[:n].copy_(shortlist.frame.sink_ids)

    def set_block_tables(self, block_table: torch.Tensor) -> None:
        """The due requests' block tables [n, width] (width <= max_blocks); columns past
        width are never read (a row's tables reach its tail's last block)."""
        self.block_table[:block_table.shape[0], :block_table.shape[1]].copy_(block_table)

    # ---- a round --------------------------------------------------------------------
    def load(self, tokens: torch.Tensor, picked: np.ndarray | None, query_rows: np.ndarray,
             refresh_rows: np.ndarray, positions: np.ndarray, num_selected: np.ndarray,
             tail_start: np.ndarray, query_buffer: torch.Tensor):
        """Re-select and load the next pass of n requests, one token each: request i's
        token is tokens[picked[i]] (picked None: tokens[i]; the round's, on the device), at
        positions[i]; it re-selects with the query at row query_rows[i] of `query_buffer`
        (the round's, [L, T, Hq * D]) and records at refresh row refresh_rows[i], with
        the sizes (num_selected, tail_start) of its selection. Returns (the loaded pass,
        for the middle level's `replay`; the selection [n, L, max_selected] and the
        refresh rows [n], both on the device), or None: the pass fits no bucket, the query
        buffer is not the one the graphs read, or the graphs were given up; then nothing
        is written and the caller takes today's path."""
        n = len(positions)
        if (tokens.shape[0] > self.tokens.shape[0] or self.failed is not None
                or not self._reads(query_buffer)):
            return None
        ready = self._ready(positions, num_selected, tail_start, rerank=True)
        if ready is None:
            return None
        replay, bucket, run, view = ready
        view["picked"][:n] = np.arange(n) if picked is None else picked
        view["query_rows"][:n] = query_rows
        view["refresh_rows"][:n] = refresh_rows
        self._copy_staged()
        self.tokens[:tokens.shape[0]].copy_(tokens)  # after the staged values: its part
        self.launch(run)
        replay.refresh()  # the pass's metadata from its lengths, as `load_runs` does
        return (LoadedPass(replay, bucket, n, n), self.selected[:n],
                self.views["refresh_rows"][:n])

    def load_selected(self, token_ids, positions: np.ndarray, num_selected: np.ndarray,
                      tail_start: np.ndarray, selected: torch.Tensor):
        """Load the pass of n requests, one token each: request i's token token_ids[i]
        (host) at positions[i], over the selection it holds already, `selected` [n, L,
        max_selected] (its sizes num_selected[i], tail_start[i]): a step's first middle
        pass, whose selection the step's start made. The same layout and writes as `load`
        after its re-ranking, as one run (the bucket's graph without the re-ranking), over
        the block tables set last (`set_block_tables`: the caller's, these requests').
        Returns the loaded pass, or None (nothing written): it fits no bucket, or the
        graphs were given up."""
        n = len(positions)
        if self.failed is not None:
            return None
        ready = self._ready(positions, num_selected, tail_start, rerank=False)
        if ready is None:
            return None
        replay, bucket, run, view = ready
        view["picked"][:n] = np.arange(n)
        view["tokens"][:n] = token_ids
        self.selected[:n].copy_(selected)
        self._copy_staged()
        self.launch(run)
        replay.refresh()
        return LoadedPass(replay, bucket, n, n)

    def _ready(self, positions: np.ndarray, num_selected: np.ndarray, tail_start: np.ndarray,
               rerank: bool):
        """A load's bucket prepared and the host's staged values written for n requests
        of one token at `positions`, with the sizes of their selections (`load` and
        `load_selected` add theirs): (the bucket's replay, the bucket, its run, the host's
        views), or None where no bucket fits or the capture failed."""
        n = len(positions)
        layout = TableLayout.of(num_selected, tail_start, positions + 1,
                                self.bounds.block_size)
        bucket = self.bounds.bucket(n, layout.width, 1)
        if bucket is None:
            return None
        reqs = self.bounds.requests_of(bucket)
        replay = self.graphs.replay_of(bucket)  # before the load: a first one clears it
        run = self.runs.get((bucket, rerank)) or self._prepare(bucket, rerank)
        if run is None:
            return None
        self.host.fill(0)
        view = self.host_views
        view["positions"][:n] = positions
        view["owner"][:n] = np.arange(n)
        view["valid"][:n] = 1
        view["num_selected"][:n] = num_selected
        view["tail_start"][:n] = tail_start
        view["num_tails"][:n] = layout.num_tails
        view["seq_lens"][:n] = layout.compact_lens
        view["query_start_loc"][1:n + 1] = np.arange(1, n + 1)
        view["query_start_loc"][n + 1:reqs + 1] = n
        return replay, bucket, run, view

    def _copy_staged(self) -> None:
        """The host's staged values to the device, in one copy that does not wait."""
        host = torch.from_numpy(self.host)
        if self.staged.is_cuda:  # pinned: the copy does not wait (engine/device/transfer)
            host = host.pin_memory()
        self.staged.copy_(host, non_blocking=True)

    def launch(self, run) -> None:
        """A bucket's `run` (its closure, or its CUDA graph's replay): where a profiler
        counts one launch (tools/bench/host_ops.py)."""
        run()

    def _reads(self, query_buffer: torch.Tensor) -> bool:
        """Whether the graphs read `query_buffer` (the first one they are given): a
        captured graph reads the address it was captured with, and nothing else."""
        if self.query_buffer is None:
            self.query_buffer = query_buffer
        return query_buffer is self.query_buffer

    def closure(self, bucket: int, rerank: bool = True) -> None:
        """What a bucket runs (and a graph records): `rerank`, from the query buffer and
        the listed buffers, the selection (into `selected`); then, from the staged values
        and `selected`, the next pass (into the round buffers: round_graph.PassBuffers,
        its tables and slots as `load_runs` lays them out: `write_tables`)."""
        reqs = self.bounds.requests_of(bucket)
        s = self.views
        if rerank:
            query_buffer = self.query_buffer
            query = query_buffer[:, s["query_rows"][:reqs]].transpose(0, 1).reshape(
                reqs, query_buffer.shape[0], self.num_heads, self.head_size)
            self.selected[:reqs].copy_(self.compiled.choose_listed(query,
                                                                   self._shortlist(reqs)))
        buffers, valid = self.graphs.buffers, s["valid"][:bucket] > 0
        buffers.write_tables(self.selected[:reqs], self.block_table[:reqs],
                             s["num_selected"][:reqs], s["tail_start"][:reqs],
                             s["num_tails"][:reqs], s["owner"][:bucket], s["positions"][:bucket],
                             buffers.columns.shape[0], valid)
        buffers.positions[:bucket].copy_(s["positions"][:bucket])
        buffers.input_ids[:bucket].copy_(torch.where(valid, self.tokens[s["picked"][:bucket]],
                                                     0))
        buffers.query_start_loc[:reqs + 1].copy_(s["query_start_loc"][:reqs + 1])
        buffers.seq_lens[:reqs].copy_(s["seq_lens"][:reqs])

    def _shortlist(self, reqs: int) -> Shortlist:
        """The listed buffers' first `reqs` rows as a Shortlist (`choose_listed` reads its
        rows, counts, padding, logical blocks and frame)."""
        if reqs not in self._shortlists:
            self._shortlists[reqs] = Shortlist(
                self.logical[:reqs], None, Frame(self.num_chosen[:reqs],
                                                 self.sink_ids[:reqs], None, None),
                rows=self.summary_rows[:reqs], counts=self.counts[:reqs],
                padding=self.padding[:reqs])
        return self._shortlists[reqs]

    def _prepare(self, bucket: int, rerank: bool):
        """The bucket's run, with the re-ranking or without: its closure (eager), or, with
        CUDA graphs, every bucket's two captured at the first load, largest first, into
        one pool of their own (after an eager run each: the compiled functions' first
        calls happen outside the capture). A capture that fails gives the graphs up, with
        a warning (None). The re-ranking reads the round graphs' query buffer, which their
        own capture (before this one: `_ready`) made."""
        if not self.use_cuda_graphs:
            self.runs[bucket, rerank] = lambda: self.closure(bucket, rerank)
            return self.runs[bucket, rerank]
        if self.query_buffer is None:  # the round graphs' capture made it
            self.query_buffer = self.graphs.query_buffers.buffers.get("query")
        if self.query_buffer is None:
            return None
        start = time.perf_counter()
        try:
            self._pool = torch.cuda.graph_pool_handle()
            for size in sorted(self.bounds.buckets, reverse=True):
                for reranks in (True, False):
                    self.closure(size, reranks)  # warm-up, over what is staged
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        self.closure(size, reranks)
                    self.runs[size, reranks] = graph.replay
        except Exception as exc:  # noqa: BLE001 - capture and dynamo fail many ways
            self.failed = f"{type(exc).__name__}: {first_line(exc)}"
            self.runs.clear()
            logger.warning("TriForce selection_graphs: capturing a middle round's "
                           "re-selection failed (%s); rounds re-select the per-call way.",
                           self.failed)
            return None
        logger.info("TriForce selection graphs: %d captured in %.1f s", len(self.runs),
                    time.perf_counter() - start)
        return self.runs[bucket, rerank]


def _staged_views(staged, tokens: int, reqs: int) -> dict:
    """Name -> view of the staged values (device or host), in `SELECTION_TOKEN_FIELDS`,
    `SELECTION_REQUEST_FIELDS`, then query_start_loc order."""
    views, start = {}, 0
    for name in SELECTION_TOKEN_FIELDS:
        views[name], start = staged[start:start + tokens], start + tokens
    for name in SELECTION_REQUEST_FIELDS:
        views[name], start = staged[start:start + reqs], start + reqs
    views["query_start_loc"] = staged[start:start + reqs + 1]
    return views

