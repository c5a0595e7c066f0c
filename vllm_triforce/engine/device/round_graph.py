"""The passes of a middle round over persistent buffers: one pass shape per token bucket,
its attention metadata built once, captured as a CUDA graph on a GPU and replayed eagerly
over the same buffers everywhere else. The retrieval level's passes (the target over a
table per layer) and the small draft's (one table, each request's last token sampled)
each have their own `RoundGraphs`.

Why. Today's path (`forward.run_pass`) builds a pass's inputs, its per-layer metadata and
its forward context anew every round, and on a GPU runs vLLM's compiled model without
CUDA graphs: a middle round of Llama-3.1-8B's shape costs ~25 ms of host time for ~7 ms of
device work. Here every input a round's pass reads lives in a buffer allocated once
(`PassBuffers`: ids, positions, slots, query starts, sequence lengths, the per-layer tables
[layers, requests, width]); a round writes them (`PassBuffers.load`) and runs its bucket
(`BucketPass`), whose per-layer metadata were built once over views of those buffers.

Buckets. A pass of T tokens over R requests runs in the smallest bucket of at least T
tokens (`RoundBounds.buckets`), with R_pad = min(bucket, max_requests) request rows (a
request has at least one token, so R <= T <= bucket). Padding cannot write and is never
read: padded tokens have slot -1 (vLLM's PADDING_SLOT_ID, vllm/v1/spec_decode/utils.py,
which every KV-cache write skips), id 0 and position 0; padded requests have no query
token (the query starts repeat T) and sequence length 0; the metadata's host values are
the bucket's bounds (its token and request counts, `max_query_len`, `max_seq_len` the
widest row's tokens), the same at every round, as a CUDA graph freezes them. A pass larger
than the largest bucket, wider than `RoundBounds.max_width` or with a longer query than
`max_query_len` takes today's path (`RoundGraphs.run` returns None).

Sliding-window layers (Gemma 2 and 3, gpt-oss) beside the full-attention ones run in the
same pass as `WindowLayers.passes` runs them: each of their KV-cache groups has its own
table [R, a max_model_len request's blocks] and slots [T] in the buffers, beside the
tokens' true lengths [R] (`WindowGroup`); its metadata is built once per bucket over them,
its host lengths a max_model_len request's on a GPU. Chunked layers (Llama 4) keep today's
path: vLLM's builder splits each request into chunks as it builds.

Per round, what cannot be frozen is refreshed in place (`BucketPass.refresh`), as the
pass is loaded: the scheduler metadata that CPU_ATTN and FA3 compute from the lengths
(vLLM's builders make it in `build()`; vllm/v1/attention/backends/cpu_attn.py and
flash_attn.py, 0.32.0) is built again over the buffers and handed to the captured objects
(eager) or copied into the captured tensor (CUDA graph). Nothing else is built per round.

Loading ahead. The middle level's pass is written from the host's values (`load_runs`: one
copy to the device, its tables laid out into the buffer) and replayed apart (`replay`),
so the middle loop loads a round's pass before the last round's copy to the host, while
the device still runs that round (engine/middle.py `MiddleLoop._ahead`): on a GPU the
copy, the tables and the refresh queue behind the last replay, and after the copy the
host launches the replay and nothing else.

Replays. `EagerReplay` runs the bucket's closure (forward context, model, logits) over the
buffers: the CPU's twin of the graph, and the path of a GPU run that captures no graph
(tensor parallelism). FLASHINFER and FLEX_ATTENTION build metadata per layer and keep
today's path (`RoundGraphs.path`). `CudaGraphReplay` captures the same closure once per bucket
(largest first, in one private memory pool, after vLLM's KV cache exists) and replays it;
on FLASH_ATTN and TRITON_ATTN only, with one tensor-parallel rank (custom all-reduce must
be captured under vLLM's `graph_capture`, not done here). The capture hook copies each
layer's query into `CaptureBuffers` inside the closure, so a graph's replay refreshes them
too (engine/device/capture.py).

`ReplayGuard` (tests): a spy on the target layers' attention that records, at a bucket's
first run, every input tensor's address and every host value the attention reads, and
fails any later run that differs: what a real CUDA graph would silently freeze.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from vllm_triforce.engine.device.bounds import GRAPH_BACKENDS, RoundBounds
from vllm_triforce.engine.device.capture import CaptureBuffers
from torch._dynamo.decorators import mark_static, mark_unbacked

from vllm_triforce.core.compiled import CompiledFunction, dense, first_line, inference
from vllm_triforce.core.tables import TableLayout, table_rows
from vllm_triforce.engine.device.forward import (HostPass, PassInputs, Runs, SWAP_TABLE,
                                                 _with_table, kv_slots, metadata_path)
from vllm_triforce.engine.device.transfer import to_device

logger = logging.getLogger(__name__)

PADDING_SLOT = PADDING_SLOT_ID  # -1: every KV-cache write skips the token
# Metadata fields a builder computes from the lengths (host work a graph cannot redo).
REFRESHED_FIELDS = ("scheduler_metadata",)


@dataclass(frozen=True)
class WindowGroup:
    """A KV-cache group of the target's sliding-window layers, as the middle level's
    buffers serve it (forward.py `WindowLayers`: every pass runs them over their group's
    table at the tokens' true lengths, writing their group's slots): its id, its layers,
    their attention group, its block size, and the columns of its table a pass can reach
    (a max_model_len request's)."""
    gid: int
    names: tuple[str, ...]
    group: object  # vLLM's AttentionGroup of these layers
    block_size: int
    width: int


class PassBuffers:
    """The persistent inputs of a level's passes, at the bounds' largest shape (device)."""

    def __init__(self, bounds: RoundBounds, num_tables: int, device,
                 windows: tuple[WindowGroup, ...] = ()):
        """`num_tables`: one per layer (the middle level), or 1 shared by every layer (the
        small draft). `windows`: the target's sliding-window groups, each with a table
        [R, its width] and slots [T] of its own, and the tokens' true lengths [R] shared."""
        tokens, reqs, width = bounds.max_tokens, bounds.max_requests, bounds.max_width
        self.input_ids = torch.zeros(tokens, dtype=torch.int32, device=device)  # [T]
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)  # [T]
        self.slot_mapping = torch.full((tokens,), PADDING_SLOT, dtype=torch.int64,
                                       device=device)  # [T]
        self.query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=device)  # [R]
        self.tables = torch.zeros(num_tables, reqs, width, dtype=torch.int32,
                                  device=device)  # [L or 1, R, W]
        with torch.inference_mode():  # as the engine's other inputs of the compiled layout
            self.columns = torch.arange(width, device=device)  # [W]: a table's column numbers
        self.block_size = bounds.block_size
        self.layout = PassLayout(bounds.block_size)  # `load_runs`' tables and slots
        self.windows = windows
        self.true_lens = torch.zeros(reqs if windows else 0, dtype=torch.int32,
                                     device=device)  # [R] each request's newest position + 1
        self.window_tables = {w.gid: torch.zeros(reqs, w.width, dtype=torch.int32,
                                                 device=device) for w in windows}  # [R, W_g]
        self.window_slots = {w.gid: torch.full((tokens,), PADDING_SLOT, dtype=torch.int64,
                                               device=device) for w in windows}  # [T]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.input_ids, self.positions, self.slot_mapping,
                                      self.query_start_loc, self.seq_lens, self.tables,
                                      self.columns, self.true_lens, *self.window_tables.values(),
                                      *self.window_slots.values()))

    def load(self, inputs: PassInputs, tables: torch.Tensor, bucket: int,
             bucket_requests: int) -> None:
        """Write a pass (`inputs`, tables [L, R, W]) into the buffers, padded to the bucket
        (module docstring). Table entries past a row's length are never read: what an
        earlier round left there stays."""
        num_tokens, num_reqs, width = inputs.num_tokens, len(inputs.seq_lens), tables.shape[-1]
        self.input_ids[:num_tokens].copy_(inputs.input_ids)
        self.input_ids[num_tokens:bucket].zero_()
        self.positions[:num_tokens].copy_(inputs.positions)
        self.positions[num_tokens:bucket].zero_()
        self.slot_mapping[:num_tokens].copy_(inputs.slot_mapping)
        self.slot_mapping[num_tokens:bucket].fill_(PADDING_SLOT)
        self.query_start_loc[:num_reqs + 1].copy_(inputs.query_start_loc_dev)
        self.query_start_loc[num_reqs + 1:bucket_requests + 1].fill_(num_tokens)
        self.seq_lens[:num_reqs].copy_(inputs.seq_lens_dev)
        self.seq_lens[num_reqs:bucket_requests].zero_()
        self.tables[:, :num_reqs, :width].copy_(tables)

    def load_runs(self, token_ids, runs: Runs, block_table: torch.Tensor, layout: TableLayout,
                  selected: torch.Tensor, bucket: int, bucket_requests: int,
                  window_tables: dict | None = None) -> None:
        """`load` of a middle round's pass straight from what the host decided, with no
        `PassInputs` and no tables of its own in between: request i runs runs.lens[i]
        tokens from runs.starts[i] with the flat ids `token_ids` (a host list or array, or
        a device tensor), over the rows `layout` lays out of `selected` [R, L,
        max_selected] and block_table [R, max_blocks] (`laid_out_tables`, written into the
        table buffer). Every host value goes in one non-blocking copy, already padded to
        the bucket (module docstring); the slots are worked out on the device, as
        `forward.build_pass` does. The same values as `build_pass` then `load`: the test
        of round graphs holds them to today's path. With sliding-window groups,
        `window_tables` (gid -> the requests' rows of that group's block table [n, width],
        device) go into their tables, their slots worked out alike, and the true lengths
        (runs.starts + runs.lens) ride in the same copy."""
        lens = runs.lens
        num_reqs, num_tokens = len(lens), int(lens.sum())
        padded = _padded(lens, runs.flat(), layout.compact_lens, token_ids, bucket,
                         bucket_requests)
        owner = np.repeat(np.arange(num_reqs), lens)  # [T] each token's request
        true_lens = []
        if self.windows:
            true_lens = [np.zeros(bucket_requests, dtype=np.int64)]
            true_lens[0][:num_reqs] = runs.starts + lens
        on_device = to_device(block_table.device, *padded, owner, layout.num_selected,
                              layout.tail_start, layout.num_tails, *true_lens)
        n = len(padded)
        padded_dev, true_dev = on_device[:n], on_device[n + 4:]
        owner_dev, num_selected, tail_start, num_tails = on_device[n:n + 4]
        positions_dev = self._write_padded(token_ids, *padded_dev, num_tokens, bucket,
                                           bucket_requests)
        self.write_tables(selected, block_table, num_selected, tail_start, num_tails,
                          owner_dev, positions_dev[:num_tokens], layout.width)
        self.slot_mapping[num_tokens:bucket].fill_(PADDING_SLOT)
        if self.windows:
            self._write_windows(window_tables, true_dev[0], owner_dev,
                                positions_dev[:num_tokens], bucket, bucket_requests)

    def _write_windows(self, window_tables: dict, true_lens: torch.Tensor,
                       owner: torch.Tensor, positions: torch.Tensor, bucket: int,
                       bucket_requests: int) -> None:
        """The sliding-window groups' part of a load: each group's table rows (its columns
        past the buffer's width are never read: `RoundGraphs.load_runs` checks the
        lengths), its tokens' slots (padding -1), and the true lengths [bucket_requests]
        (padding 0)."""
        num_tokens = positions.shape[0]
        self.true_lens[:bucket_requests].copy_(true_lens)
        for w in self.windows:
            table = window_tables[w.gid]  # [n, width]
            num_reqs, columns = table.shape[0], min(table.shape[1], w.width)
            self.window_tables[w.gid][:num_reqs, :columns].copy_(table[:, :columns])
            slots = self.window_slots[w.gid]
            slots[:num_tokens].copy_(kv_slots(table, owner, positions, w.block_size))
            slots[num_tokens:bucket].fill_(PADDING_SLOT)

    def load_host(self, token_ids, host: HostPass, block_table: torch.Tensor, bucket: int,
                  bucket_requests: int) -> None:
        """`load` of a pass over one table that the host describes (`HostPass`: the small
        draft's), with the flat ids `token_ids` (a host list or array, or a device tensor):
        every host value, padded to the bucket, in one non-blocking copy; the table's
        blocks and the tokens' KV blocks read from block_table [rows, B] in one gather,
        the slots worked out from them (as `forward.kv_slots`). Columns past a row are
        read as column 0 (any block: never read)."""
        lens, columns = host.lens, host.columns
        num_reqs, num_tokens, width = len(lens), host.num_tokens, columns.shape[1]
        padded = _padded(lens, host.positions, host.seq_lens, token_ids, bucket,
                         bucket_requests)
        # one gather: the table's blocks [n * W], then each token's KV block [T]
        kv = host.kv_positions
        gather_rows = np.concatenate([np.repeat(host.rows, width), np.repeat(host.rows, lens)])
        gather_columns = np.concatenate([np.maximum(columns, 0).reshape(-1),
                                         kv // self.block_size])
        (*padded_dev, rows_dev, columns_dev, offsets_dev) = to_device(
            block_table.device, *padded, gather_rows, gather_columns, kv % self.block_size)
        self._write_padded(token_ids, *padded_dev, num_tokens, bucket, bucket_requests)
        blocks = block_table[rows_dev, columns_dev]  # [n * W + T]
        self.tables[0, :num_reqs, :width].copy_(blocks[:num_reqs * width].view(num_reqs, width))
        torch.add(offsets_dev, blocks[num_reqs * width:], alpha=self.block_size,
                  out=self.slot_mapping[:num_tokens])
        self.slot_mapping[num_tokens:bucket].fill_(PADDING_SLOT)

    def _write_padded(self, token_ids, positions: torch.Tensor, ids: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                      bucket: int, bucket_requests: int) -> torch.Tensor:
        """`_padded`'s values, on the device, into the buffers (the ids from `token_ids`
        where they are a device tensor); returns the positions."""
        self.positions[:bucket].copy_(positions)
        if isinstance(token_ids, torch.Tensor):
            self.input_ids[:num_tokens].copy_(token_ids)
            self.input_ids[num_tokens:bucket].zero_()
        else:
            self.input_ids[:bucket].copy_(ids)
        self.query_start_loc[:bucket_requests + 1].copy_(query_start_loc)
        self.seq_lens[:bucket_requests].copy_(seq_lens)
        return positions

    def write_tables(self, selected: torch.Tensor, block_table: torch.Tensor,
                     num_selected: torch.Tensor, tail_start: torch.Tensor,
                     num_tails: torch.Tensor, owner: torch.Tensor, positions: torch.Tensor,
                     width: int, valid: torch.Tensor | None = None) -> None:
        """A pass's per-layer tables and its tokens' KV slots, laid out on the device
        (`layout`) of `selected` [R, L, max_selected] and block_table [R, B] with a
        TableLayout's sizes [R] each, into the buffers: the R requests' tables `width`
        blocks wide, and the slots of the T tokens at positions [T] of requests owner [T]
        (-1 where `valid` [T] is False: padding). `load_runs` writes its real rows so;
        a selection graph its whole bucket (engine/device/selection_graph.py)."""
        rows, slots = self.layout(selected, block_table, num_selected, tail_start, num_tails,
                                  self.columns[:width], owner, positions)
        if valid is not None:
            slots = torch.where(valid, slots, PADDING_SLOT)
        self.slot_mapping[:positions.shape[0]].copy_(slots)
        self.tables[:, :selected.shape[0], :width].copy_(rows.transpose(0, 1))

    def clear(self) -> None:
        """A pass of padding only: what a bucket is built and captured over."""
        self.slot_mapping.fill_(PADDING_SLOT)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.true_lens.zero_()
        for slots in self.window_slots.values():
            slots.fill_(PADDING_SLOT)


def _padded(lens: np.ndarray, positions: np.ndarray, seq_lens, token_ids, bucket: int,
            bucket_requests: int) -> tuple[np.ndarray, ...]:
    """A pass's host values padded to its bucket (module docstring): positions [bucket],
    ids [bucket] (none where `token_ids` is a device tensor), query starts
    [bucket_requests + 1] and lengths [bucket_requests], for requests of lens [n] tokens
    whose compacted rows hold seq_lens [n]."""
    num_reqs, num_tokens = len(lens), int(lens.sum())
    padded_positions = np.zeros(bucket, dtype=np.int64)
    padded_positions[:num_tokens] = positions
    query_start_loc = np.full(bucket_requests + 1, num_tokens, dtype=np.int64)
    query_start_loc[0] = 0
    np.cumsum(lens, out=query_start_loc[1:num_reqs + 1])
    padded_lens = np.zeros(bucket_requests, dtype=np.int64)
    padded_lens[:num_reqs] = seq_lens
    on_host = not isinstance(token_ids, torch.Tensor)
    ids = np.zeros(bucket if on_host else 0, dtype=np.int64)
    if on_host:
        ids[:num_tokens] = token_ids
    return padded_positions, ids, query_start_loc, padded_lens


def pass_layout(selected: torch.Tensor, block_table: torch.Tensor, num_selected: torch.Tensor,
                tail_start: torch.Tensor, num_tails: torch.Tensor, columns: torch.Tensor,
                owner: torch.Tensor, positions: torch.Tensor, *,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A middle round's pass laid out on the device: its per-layer tables' rows [R, L, W]
    (core/tables.table_rows of `selected` [R, L, max_selected], block_table [R, B] and a
    `TableLayout`'s sizes [R] each, W = len(columns)) and its tokens' KV slots [T] (owner
    [T] each token's request, positions [T]), as `forward.build_pass` computes them."""
    rows = table_rows(selected, block_table, num_selected, tail_start, num_tails, columns)
    return rows, kv_slots(block_table, owner, positions, block_size)


class PassLayout:
    """`pass_layout` for one level's buffers: eagerly (a dozen and a half operations), or,
    once `compile` has run (`compiled_selection`, core/compiled.py), as one compiled
    function for every size. A compiled call that fails (it would have compiled again)
    is dropped with a warning, and the layout is eager from then on."""

    def __init__(self, block_size: int):
        self.eager = functools.partial(pass_layout, block_size=block_size)
        self.compiled: CompiledFunction | None = None

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is None:
            return self.eager(*args)
        try:
            return self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
            logger.warning("TriForce compiled_selection: the compiled pass layout failed (%s: "
                           "%s); middle passes are laid out eagerly from now on.",
                           type(exc).__name__, first_line(exc))
            self.compiled = None
            return self.eager(*args)

    def compile(self, num_layers: int, max_selected: int, device) -> float:
        """Compile now (2 requests of 2 and 1 tokens, tables of 3 columns), for the
        engine's dtypes (selections int32, engine/selections.py; vLLM's block tables int32):
        the seconds it took. A compilation that fails raises and leaves the layout eager."""
        start = time.perf_counter()
        self.compiled = CompiledFunction(self.eager)
        ids = functools.partial(torch.zeros, dtype=torch.long, device=device)
        try:
            self._compiled(ids(2, num_layers, max_selected, dtype=torch.int32),
                           ids(2, 4, dtype=torch.int32),
                           ids(2), ids(2), ids(2), torch.arange(3, device=device),
                           torch.tensor([0, 0, 1], device=device), ids(3), compile_now=True)
        except Exception:
            self.compiled = None  # eager, as before
            raise
        return time.perf_counter() - start

    def _compiled(self, *args: torch.Tensor, compile_now: bool = False):
        args = [inference(dense(t)) for t in args]
        if compile_now:
            selected, block_table, *sizes, columns, owner, positions = args
            for t in (selected, block_table, *sizes, owner, positions, columns):
                mark_unbacked(t, 0)  # requests; W columns; T tokens
            mark_unbacked(block_table, 1)  # the batch's table width
            mark_static(selected, 1)  # layers
            mark_static(selected, 2)  # max_selected
        return self.compiled(*args, compile_now=compile_now)


class BucketPass:
    """One bucket's pass: views of the buffers, the per-layer metadata built over them
    once, and the closure a replay runs (forward context, model, logits of every row)."""

    def __init__(self, owner: "RoundGraphs", tokens: int):
        buffers, bounds = owner.buffers, owner.bounds
        self.owner = owner
        self.tokens, self.requests = tokens, bounds.requests_of(tokens)
        reqs = self.requests
        self.input_ids = buffers.input_ids[:tokens]
        self.positions = buffers.positions[:tokens]
        self.slot_mapping = buffers.slot_mapping[:tokens]
        # host copies that builders read on the host: on the CPU the buffers themselves;
        # on a GPU fixed bounds (a graph freezes host values)
        qsl_bound = (torch.arange(reqs + 1, dtype=torch.int32) * bounds.max_query_len).clamp_(
            max=tokens)
        lens_bound = torch.full((reqs,), bounds.max_seq_len, dtype=torch.int32)
        on_host = owner.buffers_on_host
        self.common = CommonAttentionMetadata(
            query_start_loc=buffers.query_start_loc[:reqs + 1],
            query_start_loc_cpu=buffers.query_start_loc[:reqs + 1] if on_host else qsl_bound,
            seq_lens=buffers.seq_lens[:reqs],
            num_reqs=reqs,
            num_actual_tokens=tokens,
            max_query_len=bounds.max_query_len,
            max_seq_len=bounds.max_seq_len,
            block_table_tensor=buffers.tables[0, :reqs],
            slot_mapping=self.slot_mapping,
            causal=True,
            seq_lens_cpu_upper_bound=buffers.seq_lens[:reqs] if on_host else lens_bound,
        )
        self.group = owner.group
        base = self.group.build_metadata(self.common)
        if buffers.tables.shape[0] == 1:  # one table for every layer: one metadata
            self.metas = dict.fromkeys(owner.layer_names, base)
        else:
            builder = self.group.get_metadata_builder()
            self.metas = {name: _with_table(builder, base, buffers.tables[i, :reqs],
                                            self.slot_mapping)
                          for i, name in enumerate(owner.layer_names)}
        self.slots_by_layer = dict.fromkeys(self.metas, self.slot_mapping)
        # what `refresh` builds again: (metadata over the buffers, its group, its layers)
        self.commons = [(self.common, self.group, list(owner.layer_names))]
        for window in owner.windows:
            self._add_window(window, qsl_bound, on_host)
        # sample_last: each request's last token, its row found in the graph from the
        # query starts (a padded request's is the last real token: read, never used)
        self.query_ends = buffers.query_start_loc[1:reqs + 1] if owner.sample_last else None

    def _add_window(self, window: WindowGroup, qsl_bound: torch.Tensor, on_host: bool) -> None:
        """A sliding-window group's metadata over its own buffers (its table and slots, the
        true lengths; the query starts shared), built once, as `WindowLayers.passes`
        builds it per pass; on a GPU its host lengths are a max_model_len request's."""
        buffers, reqs, tokens = self.owner.buffers, self.requests, self.tokens
        longest = window.width * window.block_size
        true_lens = buffers.true_lens[:reqs]
        slots = buffers.window_slots[window.gid][:tokens]
        common = CommonAttentionMetadata(
            query_start_loc=self.common.query_start_loc,
            query_start_loc_cpu=self.common.query_start_loc_cpu,
            seq_lens=true_lens,
            num_reqs=reqs,
            num_actual_tokens=tokens,
            max_query_len=self.common.max_query_len,
            max_seq_len=longest,
            block_table_tensor=buffers.window_tables[window.gid][:reqs],
            slot_mapping=slots,
            causal=True,
            seq_lens_cpu_upper_bound=(true_lens if on_host else
                                      torch.full((reqs,), longest, dtype=torch.int32)),
        )
        self.metas.update(dict.fromkeys(window.names, window.group.build_metadata(common)))
        self.slots_by_layer.update(dict.fromkeys(window.names, slots))
        self.commons.append((common, window.group, list(window.names)))

    def refresh(self, in_place: bool) -> None:
        """The metadata a builder computes from the lengths, built again over the buffers
        (for TriForce's layers, and for each sliding-window group's): handed to the
        per-layer objects (eager), or copied into the tensors they hold (a captured graph
        reads those addresses)."""
        for common, group, names in self.commons:
            fresh = group.build_metadata(common)
            for field in REFRESHED_FIELDS:
                value = getattr(fresh, field, None)
                if not isinstance(value, torch.Tensor):
                    continue
                if in_place:  # the group's layers share the captured tensor
                    getattr(self.metas[names[0]], field).copy_(value)
                else:
                    for name in names:
                        setattr(self.metas[name], field, value)

    def closure(self) -> torch.Tensor:
        """[bucket tokens, V] logits of the pass over the buffers (what a graph records)."""
        owner = self.owner
        with set_forward_context(self.metas, owner.vllm_config, num_tokens=self.tokens,
                                 slot_mapping=self.slots_by_layer):
            hidden = owner.model(input_ids=self.input_ids, positions=self.positions,
                                 intermediate_tensors=None, inputs_embeds=None)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if self.query_ends is not None:
            hidden = hidden[self.query_ends.long() - 1]  # [R_pad, hidden]
        return owner.model.compute_logits(hidden)


class EagerReplay:
    """Runs a bucket's closure over the buffers: the CPU's twin of a CUDA graph."""

    def __init__(self, bucket: BucketPass):
        self.bucket = bucket

    def refresh(self) -> None:
        """After a load: the metadata built from the lengths, handed to the layers."""
        self.bucket.refresh(in_place=False)

    def run(self) -> torch.Tensor:
        return self.bucket.closure()


class CudaGraphReplay:
    """A bucket's closure captured as one CUDA graph in `pool` (after one eager warm-up
    run), replayed with its scheduler metadata refreshed in place. Its logits live in the
    pool: read them before the next round's replay."""

    def __init__(self, bucket: BucketPass, pool):
        self.bucket = bucket
        bucket.refresh(in_place=True)
        bucket.closure()  # warm-up: lazy initialisations happen outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = bucket.closure()

    def refresh(self) -> None:
        """After a load: the metadata built from the lengths, copied into the captured
        tensors (on the stream, after the last replay that read them)."""
        self.bucket.refresh(in_place=True)

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class RoundGraphs:
    """The owner of the middle level's passes over persistent buffers (module docstring):
    `run` loads a pass into the buffers and replays its bucket, or returns None for a pass
    that fits no bucket. Built for the target `model` and its attention `group` (the one
    KV-cache group; its layers `layer_names`, in layer order), `bounds`, and the capture
    whose round buffers the passes' queries go to."""

    def __init__(self, model, vllm_config, group, layer_names: list[str], bounds: RoundBounds,
                 capture, device, use_cuda_graphs: bool, shared_table: bool = False,
                 sample_last: bool = False, windows: tuple[WindowGroup, ...] = ()):
        """`capture` None: the model's layers are not captured (the small draft's);
        `shared_table`: one table for every layer (tables [1, R, W] in `run`);
        `sample_last`: logits of each request's last token only (else of every token);
        `windows`: the target's sliding-window groups, run beside `layer_names` in every
        pass (`load_runs`' `window_tables`)."""
        self.model, self.vllm_config = model, vllm_config
        self.group, self.layer_names = group, layer_names
        self.bounds = bounds
        self.capture = capture
        self.sample_last = sample_last
        self.windows = windows
        self.buffers = PassBuffers(bounds, 1 if shared_table else len(layer_names), device,
                                   windows)
        self.query_buffers = CaptureBuffers(len(layer_names), bounds.max_tokens,
                                            keep_keys=False)
        self.use_cuda_graphs = use_cuda_graphs
        self.buffers_on_host = torch.device(device).type == "cpu"  # no host value to freeze
        self.replays: dict[int, EagerReplay | CudaGraphReplay] = {}
        self.guard: ReplayGuard | None = None  # tests: `ReplayGuard.watching`
        self.planned_bytes = 0  # what the memory plan reserved (the proposer sets it)
        self._pool = None

    @staticmethod
    def path(backend: str, device, tensor_parallel_size: int,
             kernel_block_size: int | None) -> tuple[str, str]:
        """(path, why): "cuda graphs", "eager" (over the buffers, no graph) or "per pass"
        (today's path: the buffers cannot serve this backend)."""
        if metadata_path(backend) != SWAP_TABLE or kernel_block_size is not None:
            return "per pass", (f"{backend} builds metadata per layer" if kernel_block_size
                                is None else "kernel blocks differ from KV blocks")
        if torch.device(device).type != "cuda":
            return "eager", "no CUDA device"
        if backend not in GRAPH_BACKENDS:
            return "eager", f"{backend} is not captured"
        if tensor_parallel_size > 1:
            return "eager", "tensor parallel all-reduce is not captured yet"
        return "cuda graphs", backend

    def run(self, inputs: PassInputs, tables: torch.Tensor) -> torch.Tensor | None:
        """Logits of the pass `inputs` over tables [L or 1, R, W]: [T, V] for every token,
        or [R, V] with `sample_last`; its queries left in the capture (views of the round
        buffers). None: no bucket fits (the caller takes today's path)."""
        qsl = inputs.query_start_loc
        longest = max(b - a for a, b in zip(qsl[:-1], qsl[1:]))
        bucket = self.bounds.bucket(inputs.num_tokens, tables.shape[-1], longest)
        if bucket is None:
            return None
        replay = self.replays.get(bucket) or self._prepare(bucket)  # before the load
        self.buffers.load(inputs, tables, bucket, self.bounds.requests_of(bucket))
        replay.refresh()
        return self._replay(replay, bucket, inputs.num_tokens, len(inputs.seq_lens))

    def run_host(self, token_ids, host: HostPass,
                 block_table: torch.Tensor) -> torch.Tensor | None:
        """`run` of a pass the host describes (`PassBuffers.load_host`: the small draft's),
        with no `PassInputs` and no table on the device in between. None: no bucket fits."""
        bucket = self.bounds.bucket(host.num_tokens, host.columns.shape[1],
                                    int(host.lens.max()))
        if bucket is None:
            return None
        replay = self.replay_of(bucket)  # before the load
        self.buffers.load_host(token_ids, host, block_table, bucket,
                               self.bounds.requests_of(bucket))
        replay.refresh()
        return self._replay(replay, bucket, host.num_tokens, len(host.lens))

    def load_runs(self, token_ids, runs: Runs, block_table: torch.Tensor, layout: TableLayout,
                  selected: torch.Tensor,
                  window_tables: dict | None = None) -> "LoadedPass | None":
        """A middle round's pass written into the buffers (`PassBuffers.load_runs`: no
        `PassInputs`, no tables of its own), over the per-layer tables `layout` lays out
        of `selected` (and, with sliding-window groups, their `window_tables`: gid -> the
        requests' rows of its block table), ready for `replay`; nothing else may load the
        buffers in between. None: no bucket fits, or a request reaches past a window
        group's table."""
        num_tokens = int(runs.lens.sum())
        bucket = self.bounds.bucket(num_tokens, layout.width, int(runs.lens.max()))
        if bucket is None or not self._windows_hold(runs):
            return None
        replay = self.replay_of(bucket)  # before the load
        self.buffers.load_runs(token_ids, runs, block_table, layout, selected, bucket,
                               self.bounds.requests_of(bucket), window_tables)
        replay.refresh()  # with the load: a replay launches nothing else
        return LoadedPass(replay, bucket, num_tokens, len(runs.lens))

    def _windows_hold(self, runs: Runs) -> bool:
        """Every request's newest position lies within each sliding-window group's table."""
        if not self.windows:
            return True
        longest = int((runs.starts + runs.lens).max())
        return all(-(-longest // w.block_size) <= w.width for w in self.windows)

    def replay_of(self, bucket: int):
        """The bucket's replay, prepared now if it is the first (which clears the buffers:
        call it before a load)."""
        return self.replays.get(bucket) or self._prepare(bucket)

    def replay(self, loaded: "LoadedPass") -> torch.Tensor:
        """The logits of a pass `load_runs` loaded (the last one it loaded)."""
        return self._replay(loaded.replay, loaded.bucket, loaded.num_tokens,
                            loaded.num_reqs)

    def _replay(self, replay, bucket: int, num_tokens: int, num_reqs: int) -> torch.Tensor:
        """The loaded bucket's replay (watched by the guard, if any); its queries left in
        the capture; the real rows' logits."""
        with self._recording():
            if self.guard is not None:
                with self.guard.watching(bucket):
                    logits = replay.run()
            else:
                logits = replay.run()
        if self.capture is not None:
            self.capture.take_views(self.query_buffers, num_tokens)
        return logits[:num_reqs if self.sample_last else num_tokens]

    def _recording(self):
        """The capture's scope of a pass: its queries into the round buffers."""
        if self.capture is None:
            return contextlib.nullcontext()
        return self.capture.recording(into=self.query_buffers)

    def _prepare(self, bucket: int):
        """The bucket's replay; with CUDA graphs every bucket is captured at the first
        round, largest first, into one pool (a smaller graph reuses the larger's memory).
        Built and captured over a pass of padding only (`PassBuffers.clear`)."""
        self.buffers.clear()
        if not self.use_cuda_graphs:
            self.replays[bucket] = EagerReplay(BucketPass(self, bucket))
            return self.replays[bucket]
        self._pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        with self._recording():
            for size in sorted(self.bounds.buckets, reverse=True):
                self.replays[size] = CudaGraphReplay(BucketPass(self, size), self._pool)
        from vllm.logger import init_logger
        init_logger("vllm.triforce").info(
            "TriForce round graphs: %d captured (buckets %s) in %.1f s, their pool %.1f MiB "
            "(the plan reserved %.1f MiB for the buffers and pools)",
            len(self.replays), list(self.bounds.buckets), time.perf_counter() - start,
            self.pool_bytes() / 2**20, self.planned_bytes / 2**20)
        return self.replays[bucket]

    def pool_bytes(self) -> int:
        """What the graphs' private pool holds: its segments' bytes, found as torch's own
        CUDA-graph trees find them (`torch.cuda.memory_snapshot`, by `segment_pool_id`);
        0 before a capture. Not the change in `memory_reserved` around the capture: each
        `torch.cuda.graph` empties the allocator's cache first, so that change can be
        negative."""
        return pool_bytes(self._pool)

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes + self.query_buffers.nbytes


def pool_bytes(pool) -> int:
    """The bytes of a CUDA-graph memory pool's segments (`torch.cuda.memory_snapshot`, by
    `segment_pool_id`); 0 for None (no capture yet)."""
    if pool is None:
        return 0
    pool = tuple(pool)
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment["segment_pool_id"]) == pool)


@dataclass(frozen=True)
class LoadedPass:
    """A pass `RoundGraphs.load_runs` wrote into the buffers: its bucket's replay, the
    bucket, and the real tokens and requests in it."""
    replay: object  # EagerReplay | CudaGraphReplay
    bucket: int
    num_tokens: int
    num_reqs: int


class ReplayMismatch(AssertionError):
    """A replay read another tensor, or another host value, than its capture did."""


class ReplayGuard:
    """Holds every replay of a bucket to what its first run read (module docstring): per
    attention call, the metadata object, the addresses and shapes of its query starts,
    lengths, table and slots, its host values, and the KV cache's address. A spy wraps
    the target layers' `impl.forward` while installed (`install` / `remove`)."""

    TENSORS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    SCALARS = ("num_actual_tokens", "max_query_len", "max_seq_len", "causal")

    def __init__(self):
        self.captured: dict[int, list] = {}
        self.replays_checked = 0
        self._bucket: int | None = None
        self._seen: list = []
        self._impls: list = []

    def install(self, layers) -> "ReplayGuard":
        for layer in layers:
            impl, forward = layer.impl, layer.impl.forward
            self._impls.append((impl, forward))
            impl.forward = self._spy(forward)
        return self

    def remove(self) -> None:
        for impl, forward in self._impls:
            impl.forward = forward
        self._impls = []

    def _spy(self, forward):
        def spied(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            if self._bucket is not None and attn_metadata is not None:
                self._seen.append(self._reading(kv_cache, attn_metadata))
            return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        return spied

    def _reading(self, kv_cache, meta) -> tuple:
        tensors = tuple((name, _address(getattr(meta, name, None))) for name in self.TENSORS)
        scalars = tuple((name, getattr(meta, name, None)) for name in self.SCALARS)
        return id(meta), _address(kv_cache), tensors, scalars

    def watching(self, bucket: int):
        @contextlib.contextmanager
        def scope():
            self._bucket, self._seen = bucket, []
            try:
                yield
            finally:
                self._bucket = None
            self._check(bucket, self._seen)
        return scope()

    def _check(self, bucket: int, seen: list) -> None:
        if not seen:
            raise ReplayMismatch(f"bucket {bucket}: no attention call was seen")
        if bucket not in self.captured:
            self.captured[bucket] = seen
            return
        self.replays_checked += 1
        for i, (was, now) in enumerate(zip(self.captured[bucket], seen)):
            if was != now:
                raise ReplayMismatch(f"bucket {bucket}, attention call {i}: captured {was}, "
                                     f"replayed {now}")
        if len(seen) != len(self.captured[bucket]):
            raise ReplayMismatch(f"bucket {bucket}: {len(seen)} attention calls, captured "
                                 f"{len(self.captured[bucket])}")


def _address(tensor) -> tuple | None:
    """(data pointer, shape, strides) of a tensor; None for anything else."""
    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())
