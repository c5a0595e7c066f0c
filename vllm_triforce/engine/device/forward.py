"""Run a model over block tables the proposer chose: the only code that builds attention metadata.

Depends on vLLM 0.32.0: `CommonAttentionMetadata` (vllm/v1/attention/backend.py),
`AttentionGroup.build_metadata` (vllm/v1/worker/utils.py) and `set_forward_context`
(vllm/forward_context.py). Each attention layer looks up its own metadata by name, so a
different block table per layer needs no kernel change: the stock backend attends over
exactly the blocks listed, with causal masking bottom-right aligned on the compacted row:
query token i of q_len attends the row's entries [0, seq_len - q_len + i], so the query
tokens are always the last tokens of each row.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_triforce.engine.device.transfer import to_device
from vllm_triforce.engine_settings import check_attention_backend


@dataclass
class PassInputs:
    """One forward pass over a batch of requests: what the host decided, as Python lists,
    and the device tensors the model and the attention builders read (made once per pass,
    `PassInputs.make` / `build_pass`)."""
    query_start_loc: list[int]     # [num_reqs + 1]
    seq_lens: list[int]            # [num_reqs] tokens in each COMPACTED row
    sample_rows: list[int]         # [num_samples] token rows whose logits are wanted
    input_ids: torch.Tensor        # device [num_tokens] int32
    positions: torch.Tensor        # device [num_tokens] int64: positions the model rotates with
    slot_mapping: torch.Tensor     # device [num_tokens] int64: TRUE KV slots the tokens write to
    query_start_loc_dev: torch.Tensor  # device [num_reqs + 1] int32
    seq_lens_dev: torch.Tensor     # device [num_reqs] int32
    sample_rows_dev: torch.Tensor  # device [num_samples] int64
    # device [num_tokens] int64: the positions the tokens' KV sits at, where the model
    # rotates with others (`build_pass`'s `model_positions`); None: `positions`
    kv_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def make(cls, query_start_loc: list[int], seq_lens: list[int], sample_rows: list[int],
             input_ids: torch.Tensor, positions: torch.Tensor,
             slot_mapping: torch.Tensor) -> "PassInputs":
        """The device copies of the three lists, in one non-blocking copy."""
        qsl, lens, rows = to_device(input_ids.device, query_start_loc, seq_lens, sample_rows)
        return cls(list(query_start_loc), list(seq_lens), list(sample_rows), input_ids,
                   positions, slot_mapping, qsl.to(torch.int32), lens.to(torch.int32), rows)


@dataclass(frozen=True)
class Runs:
    """Positions of a pass whose requests each run one contiguous stretch: request i runs
    lens[i] tokens from starts[i] (host numpy arrays; a middle round's newest token and
    its proposals). The pass's host lists then come from a few array operations, not from
    a Python list per request. Example: starts [5, 2], lens [2, 1] -> positions
    [5, 6, 2]."""
    starts: np.ndarray  # [n]
    lens: np.ndarray    # [n]

    def flat(self) -> np.ndarray:
        """[T] the positions, request after request."""
        if not (self.lens > 1).any():  # one token each (a middle round of one level)
            return self.starts
        owner = np.repeat(np.arange(len(self.lens)), self.lens)
        first = np.cumsum(self.lens) - self.lens  # [n] each request's first row
        return self.starts[owner] + np.arange(owner.size) - first[owner]


@dataclass(frozen=True)
class HostPass:
    """A pass every input of which the host knows, over one table for every layer given
    as columns of the block table (the small draft's: core/streaming.py
    `DraftWindow.table_columns`), host numpy arrays: request i runs lens[i] tokens from
    `rows[i]` of the block table, writing KV at `kv_positions` (absolute) and rotating with
    `positions` (the level's own, e.g. rebased); its compacted row reads
    block_table[rows[i], columns[i]] (-1: past the row, never read) and holds seq_lens[i]
    tokens. `round_graph.PassBuffers.load_host` writes it with one copy to the device.
    Example, block size 16, one sink and two window blocks, a rebase offset of 30: the
    request in block-table row 3 runs 2 tokens at 70 and 71 (72 tokens, blocks 0..4):
    rows [3], lens [2], kv_positions [70, 71], positions [40, 41], columns [[0, 3, 4]],
    seq_lens [16 + 24]."""
    rows: np.ndarray          # [n]
    lens: np.ndarray          # [n]
    kv_positions: np.ndarray  # [T]
    positions: np.ndarray     # [T]
    columns: np.ndarray       # [n, W]
    seq_lens: np.ndarray      # [n]

    @property
    def num_tokens(self) -> int:
        return int(self.lens.sum())


def kv_slots(block_table: torch.Tensor, owner: torch.Tensor, positions: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """[T] the KV slot each token writes: block_table [R, B] physical ids, owner [T] each
    token's request, positions [T]; slot = block_table[owner, p // block_size] *
    block_size + p % block_size."""
    return (block_table[owner, positions // block_size].long() * block_size
            + positions % block_size)


def build_pass(token_ids: list | torch.Tensor, positions: list[list[int]] | Runs,
               block_table: torch.Tensor, block_size: int, seq_lens: list[int],
               sample_last: bool = False,
               model_positions: list[list[int]] | Runs | None = None) -> PassInputs:
    """One pass over n requests: request i runs `token_ids[i]` at absolute `positions[i]`.

    token_ids: a list per request, or the flat ids [T] (a host list with `Runs`
    positions, or a tensor already on the device); positions: a list per request, or
    `Runs`; block_table [n, width] (device): each request's physical blocks, used for the
    true KV slots (slot = block_table[i, p // block_size] * block_size + p % block_size),
    computed on the device; seq_lens [n]: tokens in each request's compacted row (the
    caller's table decides them). Samples every token, or with `sample_last` the last token
    of each request. Everything the host built goes to the device in one non-blocking copy.
    Example, block_size 4, two requests running [7, 8] at 5, 6 and [9] at 2, block_table
    [[10, 11], [20, 21]]: input_ids [7, 8, 9], slots [45, 46, 82], query_start_loc
    [0, 2, 3], sample_rows [0, 1, 2] (sample_last: [1, 2]). The model rotates with
    `positions`, or with `model_positions` where a level sees other positions (the small
    draft, core/streaming.py; a target with M-RoPE, its requests' position deltas).
    """
    if isinstance(positions, Runs):
        lens, flat = positions.lens.tolist(), positions.flat().tolist()
        host_ids = token_ids if not isinstance(token_ids, torch.Tensor) else None
    else:
        lens = [len(p) for p in positions]
        flat = [p for ps in positions for p in ps]  # [T]
        host_ids = (None if isinstance(token_ids, torch.Tensor)
                    else [t for ts in token_ids for t in ts])
    qsl = [0, *itertools.accumulate(lens)]  # [n + 1]
    every = not sample_last  # every token sampled: its rows are 0 .. T-1, made on the device
    sample_rows = list(range(qsl[-1])) if every else [end - 1 for end in qsl[1:]]
    rotated = (model_positions.flat().tolist() if isinstance(model_positions, Runs)
               else None if model_positions is None
               else [p for ps in model_positions for p in ps])
    pos, qsl_dev, lens_dev, rows_dev, ids, rot = to_device(
        block_table.device, flat, qsl, seq_lens, [] if every else sample_rows,
        host_ids or [], rotated or [])
    rows = torch.arange(qsl[-1], device=block_table.device)  # [T]
    if every:
        rows_dev = rows
    one_each = qsl[-1] == len(lens)  # one token per request: token t is request t's
    who = rows if one_each else torch.searchsorted(qsl_dev[1:], rows, right=True)  # [T]
    slots = kv_slots(block_table, who, pos, block_size)
    return PassInputs(qsl, list(seq_lens), sample_rows,
                      input_ids=(ids if host_ids is not None else token_ids).to(torch.int32),
                      positions=pos if rotated is None else rot, slot_mapping=slots,
                      query_start_loc_dev=qsl_dev.to(torch.int32),
                      seq_lens_dev=lens_dev.to(torch.int32), sample_rows_dev=rows_dev,
                      kv_positions=None if rotated is None else pos)


@dataclass(frozen=True)
class WindowLayers:
    """The target's local layers, beside its full-attention ones: sliding-window layers
    (Gemma 2 and 3, gpt-oss) and chunked ones (Llama 4, whose builder splits each request
    into virtual ones, a chunk each), by the KV-cache group each sits in. Every TriForce
    pass runs them as vLLM's own pass does: over their group's block table, at the
    tokens' true sequence lengths, writing their group's slots (their attention applies
    the window or the chunk; vLLM has freed the blocks behind it); only the
    full-attention layers read TriForce's tables. Example: layers 0 and 2 sliding in
    group 0, layers 1 and 3 full in group 1 (TriForce's): names {0: [layer 0, layer 2]},
    a pass of request i at positions [p, p + 1] runs layers 0 and 2 over group 0's row i
    with seq_len p + 2."""
    names: dict[int, list[str]]    # KV-cache group id -> its local layers
    block_sizes: dict[int, int]    # KV-cache group id -> its block size

    def passes(self, inputs: PassInputs, tables: dict[int, torch.Tensor],
               true_lens) -> list[tuple[PassInputs, dict]]:
        """[(the pass of a group's window layers, layer name -> its table)], one a group:
        `inputs` (TriForce's pass) at `true_lens` [n] (each request's newest position + 1),
        with its group's slots from `tables` [gid] [n, width] (device: the requests' rows
        of that group's block table)."""
        out, true_lens = [], [int(n) for n in true_lens]  # a list, or a host array
        positions = inputs.positions if inputs.kv_positions is None else inputs.kv_positions
        lens_dev = to_device(positions.device, true_lens)[0].to(torch.int32)
        rows = torch.arange(inputs.num_tokens, device=positions.device)
        who = torch.searchsorted(inputs.query_start_loc_dev[1:], rows.to(torch.int32),
                                 right=True)  # [T] each token's request
        for gid, names in self.names.items():
            table = tables[gid]
            own = dataclasses.replace(
                inputs, seq_lens=true_lens, seq_lens_dev=lens_dev,
                slot_mapping=kv_slots(table, who, positions, self.block_sizes[gid]))
            out.append((own, dict.fromkeys(names, table)))
        return out


def build_common(inputs: PassInputs, block_table: torch.Tensor) -> CommonAttentionMetadata:
    """vLLM's metadata of one pass over `block_table` [num_reqs, width] (device, int32):
    device fields from the pass's device copies, host fields from its lists, no copy."""
    qsl = inputs.query_start_loc
    return CommonAttentionMetadata(
        query_start_loc=inputs.query_start_loc_dev,
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=inputs.seq_lens_dev,
        num_reqs=len(inputs.seq_lens),
        num_actual_tokens=inputs.num_tokens,
        max_query_len=int(np.diff(qsl).max()),
        max_seq_len=max(inputs.seq_lens),
        block_table_tensor=_int32(block_table),
        slot_mapping=inputs.slot_mapping,
        causal=True,
        seq_lens_cpu_upper_bound=torch.tensor(inputs.seq_lens, dtype=torch.int32),
    )


def _int32(table: torch.Tensor) -> torch.Tensor:
    return table if table.dtype == torch.int32 else table.to(torch.int32)


# How each supported backend (config.SUPPORTED_ATTENTION_BACKENDS) gets its own block table
# per layer. Metadata built by a builder may point into that builder's persistent buffers;
# a second build() then rewrites the first layer's metadata and every layer attends over
# the LAST layer's table (outputs stay lossless, acceptance silently drops).
SWAP_TABLE = "swap table"  # stateless builder: build once per pass, shallow copy per table
BUILDER_PER_LAYER = "builder per layer"  # stateful builder: one builder (and build) per layer
METADATA_PATHS = {
    # cpu_attn.py build(): keeps the table by reference, no buffers.
    "CPU_ATTN": SWAP_TABLE,
    # flash_attn.py: table by reference; swapped through its own update_block_table.
    # (FA3 scheduler_metadata is persistent only under FULL CUDA graphs, which TriForce
    # refuses, and depends on seq_lens only.)
    "FLASH_ATTN": SWAP_TABLE,
    # triton_attn.py: table by reference; its softmax_segm_* buffers are scratch that each
    # layer's kernel uses in turn.
    "TRITON_ATTN": SWAP_TABLE,
    # flashinfer.py ~1234-1390: re-plans one wrapper per builder and fills persistent
    # paged_kv_indices. Per-layer builders share one workspace, as vLLM's V2 runner does.
    "FLASHINFER": BUILDER_PER_LAYER,
    # flex_attention.py ~1026-1072: physical_to_logical (read by the mask; [requests,
    # num_blocks] int64), the kv_indices tables and kv_num_blocks (int32, over a
    # max_model_len request's pages) are persistent, per layer at a middle pass's limits
    # (engine/shape.py: `PassLimits`; sizes: `per_layer_builder_bytes`).
    "FLEX_ATTENTION": BUILDER_PER_LAYER,
}
# Extra builders, built once: attention group -> layer name -> one-layer group.
_LAYER_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def metadata_path(backend_name: str) -> str:
    """SWAP_TABLE or BUILDER_PER_LAYER for a backend, or the allow-list's error naming the fix."""
    check_attention_backend(backend_name)
    return METADATA_PATHS[backend_name]


def layer_metadata(groups, inputs: PassInputs, tables: torch.Tensor | dict,
                   limits=None) -> dict:
    """Metadata per layer name. `tables` is one [num_reqs, width] table for every layer,
    or a mapping layer_name -> table (layers of a group missing from it belong to another
    model sharing the KV-cache group and get nothing). Layers handed the same table object
    share one metadata; distinct tables follow the backend's METADATA_PATHS entry (a
    stateful backend's per-layer builders are made for `limits`, engine/shape.py
    `PassLimits`)."""
    metas = {}
    for group in groups:
        path = metadata_path(group.backend.get_name())  # refuse unknown backends on any pass
        by_table = _layers_by_table(group.layer_names, tables)
        if not by_table:
            continue
        if len(by_table) == 1:  # one build, as vLLM's runner does for a group
            table, names = by_table[0]
            meta = group.build_metadata(build_common(inputs, table))
            metas.update(dict.fromkeys(names, meta))
        elif path == SWAP_TABLE:
            metas.update(_swap_tables(group, inputs, by_table))
        else:
            metas.update(_build_per_layer(group, inputs, by_table, limits))
    return metas


def _layers_by_table(layer_names, tables) -> list[tuple[torch.Tensor, list[str]]]:
    """[(table, layer names using it)], one entry per distinct table object, in layer order."""
    if not isinstance(tables, dict):
        return [(tables, list(layer_names))]
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name in layer_names:
        if name in tables:
            by_id.setdefault(id(tables[name]), (tables[name], []))[1].append(name)
    return list(by_id.values())


def _swap_tables(group, inputs: PassInputs, by_table) -> dict:
    """Stateless builder: build once, then one shallow copy per table holding that table.
    Every copy gets its own table, the first one too: with a kernel block size the built
    metadata's table is a view of the group's one shared `kernel_block_table` buffer."""
    common = build_common(inputs, by_table[0][0])
    base = group.build_metadata(common)
    builder = group.get_metadata_builder()
    metas = {}
    for table, names in by_table:
        own = _with_table(builder, base, _own_block_table(group, table),
                          common.slot_mapping)
        metas.update(dict.fromkeys(names, own))
    return metas


def _own_block_table(group, table: torch.Tensor) -> torch.Tensor:
    """`table` [num_reqs, width] (device) as int32, in the group's kernel blocks. The
    kernel-block mapping writes into one buffer per group, so that result is cloned."""
    table = _int32(table)
    if group.kernel_block_size is None:
        return table
    return group.map_to_kernel_block_table(table).clone()  # [num_reqs, width * blocks_per_kv]


def _with_table(builder, meta, table: torch.Tensor, slot_mapping: torch.Tensor):
    """A shallow copy of `meta` attending over `table`: the builder's own
    `update_block_table` where it has one (FLASH_ATTN), else the same copy-and-set it does
    (copy.copy, not dataclasses.replace: no __post_init__ runs again)."""
    if builder.supports_update_block_table:
        return builder.update_block_table(meta, table, slot_mapping)
    assert hasattr(meta, "block_table"), type(meta)
    own = _shallow_copy(meta)
    own.block_table = table
    return own


def _shallow_copy(obj):
    """copy.copy for an object whose state is its __dict__ (vLLM's metadata dataclasses):
    1.0 us where copy.copy takes 1.9 (one per layer per pass); anything else goes through
    copy.copy."""
    cls, state = type(obj), getattr(obj, "__dict__", None)
    if state is None or hasattr(cls, "__slots__") or hasattr(cls, "__copy__"):
        return copy.copy(obj)
    own = cls.__new__(cls)
    own.__dict__.update(state)
    return own


def _build_per_layer(group, inputs: PassInputs, by_table, limits) -> dict:
    """Stateful builder: each table is built by the builder of its first layer, so no two
    builds of a pass share a builder (each layer has its own, created once, for `limits`)."""
    assert limits is not None, "per-layer tables on a stateful backend need PassLimits"
    metas = {}
    for table, names in by_table:
        layer_group = _layer_group(group, names[0], limits)
        meta = layer_group.build_metadata(build_common(inputs, table))
        metas.update(dict.fromkeys(names, meta))
    return metas


def _limited_config(vllm_config, limits):
    """`vllm_config` with the scheduler's limits cut to `limits` (engine/shape.py
    `PassLimits`; shallow copies: everything else is the runner's own)."""
    limited, sched = copy.copy(vllm_config), copy.copy(vllm_config.scheduler_config)
    sched.max_num_seqs, sched.max_num_batched_tokens = limits.requests, limits.tokens
    limited.scheduler_config = sched
    return limited


def _layer_group(group, layer_name: str, limits):
    """A one-layer copy of `group` with its own metadata builder (and kernel-block buffer),
    created the way vLLM's runner creates a group's builders but for a middle pass's
    `limits` (engine/shape.py `PassLimits`), cached for the engine's life."""
    per_layer = _LAYER_GROUPS.setdefault(group, {})
    if layer_name not in per_layer:
        from vllm.v1.worker.utils import AttentionGroup

        source = group.get_metadata_builder()
        layer_group = AttentionGroup(
            backend=group.backend, layer_names=[layer_name], kv_cache_spec=group.kv_cache_spec,
            kv_cache_group_id=group.kv_cache_group_id,
            kernel_block_stride=group.kernel_block_stride)
        layer_group.create_metadata_builders(_limited_config(source.vllm_config, limits),
                                             source.device,
                                             kernel_block_size=group.kernel_block_size)
        _share_workspace(source, layer_group.get_metadata_builder())
        per_layer[layer_name] = layer_group
    return per_layer[layer_name]


def _share_workspace(source, builder) -> None:
    """FlashInfer builders own a large scratch workspace (hundreds of MiB); layers run one
    after another, so they can share one, as vLLM's V2 runner shares it across builders
    (vllm/v1/worker/gpu/attn_utils.py, 0.32.0)."""
    if hasattr(source, "_get_workspace_buffer") and hasattr(builder, "set_workspace_buffer"):
        builder.set_workspace_buffer(source._get_workspace_buffer())


def takes_mrope(model) -> bool:
    """Whether `model` rotates with M-RoPE (vLLM's `SupportsMRoPE`, e.g. Qwen2-VL): its
    passes take [3, T] positions (`rotary_positions`)."""
    return getattr(model, "supports_mrope", False)


def rotary_positions(model, inputs: PassInputs) -> torch.Tensor:
    """The positions `model` takes: [T], or [3, T] for a model with M-RoPE, whose compiled
    graphs take its three sections' positions. A generated token sits at the same position
    in all three (vLLM's `MRotaryEmbedding.get_next_input_positions_tensor`), the shift of
    its request's images already in `inputs.positions` (`build_pass`'s `model_positions`)."""
    if takes_mrope(model):
        return inputs.positions.expand(3, -1).contiguous()
    return inputs.positions


def run(model, vllm_config, metas: dict, inputs: PassInputs,
        slots: dict | None = None) -> torch.Tensor:
    """Forward `model` over `inputs` with per-layer `metas`; returns logits of sample_rows.
    `slots`: layer name -> the KV slots it writes (local layers write their own
    group's, `WindowLayers`); None: `inputs.slot_mapping` for every layer.

    The compiled model on CUDA asserts `num_tokens <= max_num_batched_tokens`
    (vllm/compilation/piecewise_backend.py, 0.32.0); CPU has no such check, so we assert it
    here and every caller goes through `run_pass`, which splits larger passes."""
    limit = vllm_config.scheduler_config.max_num_batched_tokens
    assert inputs.num_tokens <= limit, (
        f"TriForce pass of {inputs.num_tokens} tokens exceeds max_num_batched_tokens={limit}")
    with set_forward_context(metas, vllm_config, num_tokens=inputs.num_tokens,
                             slot_mapping=slots or dict.fromkeys(metas, inputs.slot_mapping)):
        hidden = model(input_ids=inputs.input_ids, positions=rotary_positions(model, inputs),
                       intermediate_tensors=None, inputs_embeds=None)
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    return model.compute_logits(hidden[inputs.sample_rows_dev])


# On a GPU, timing the forwards apart from the host work needs a device sync per pass:
# only benchmarks ask for it (`vllm-triforce bench speed` sets this variable).
TIME_FORWARDS_ENV = "VLLM_TRIFORCE_TIME_FORWARDS"


def run_pass(model, vllm_config, groups, inputs: PassInputs, tables,
             stats=None, limits=None, windows=(), before=None) -> torch.Tensor:
    """Build metadata and forward, in chunks of at most max_num_batched_tokens tokens.

    `tables`: one [num_reqs, width] table for every layer, or layer_name -> table; with
    per-layer tables on a stateful backend, `limits` (engine/shape.py `PassLimits`, the
    engine's `EngineShape.pass_limits`) bounds each chunk too. `windows`: the passes of
    the target's local layers (`WindowLayers.passes`), chunked alike. `before`:
    called with each chunk and its requests (a range of the pass's) before it runs (LoRA
    adapters' mapping: engine/adapters.py).
    Returns the logits of `inputs.sample_rows`, in order. With `stats`, the time of the
    model forwards goes to `stats.forward_seconds`; everything else the proposer does
    (metadata included) is host work. On a GPU that time is the device's only where
    VLLM_TRIFORCE_TIME_FORWARDS=1 (a sync per pass); else it is the launches'."""
    limit, max_reqs = vllm_config.scheduler_config.max_num_batched_tokens, None
    if isinstance(tables, dict) and any(metadata_path(g.backend.get_name()) == BUILDER_PER_LAYER
                                        for g in groups):  # per-layer builders' limits
        assert limits is not None, "per-layer tables on a stateful backend need PassLimits"
        max_reqs, limit = limits.requests, min(limit, limits.tokens)
    chunks = list(split_pass(inputs, limit, max_reqs))
    # the same pieces: each window pass has `inputs`' rows and query_start_loc
    window_chunks = [list(split_pass(own, limit, max_reqs)) for own, _ in windows]
    logits = []
    for i, (chunk, rows) in enumerate(chunks):
        chunk_tables = tables if len(chunks) == 1 else _rows_of(tables, rows)
        metas = layer_metadata(groups, chunk, chunk_tables, limits)
        slots = None
        if windows:
            slots = dict.fromkeys(metas, chunk.slot_mapping)
            for (_, own_tables), pieces in zip(windows, window_chunks):
                own = pieces[i][0]
                own_metas = layer_metadata(groups, own, own_tables if len(chunks) == 1
                                           else _rows_of(own_tables, rows), limits)
                metas.update(own_metas)
                slots.update(dict.fromkeys(own_metas, own.slot_mapping))
        if before is not None:
            before(chunk, rows)
        start = time.perf_counter()
        logits.append(run(model, vllm_config, metas, chunk, slots))
        if stats is not None:
            if logits[-1].is_cuda and os.environ.get(TIME_FORWARDS_ENV) == "1":
                torch.cuda.synchronize(logits[-1].device)
            stats.add(forward_seconds=time.perf_counter() - start)
    if stats is not None:
        stats.add(split_passes=int(len(chunks) > 1))
        stats.max_pass_tokens = max(stats.max_pass_tokens, *(c.num_tokens for c, _ in chunks))
    return logits[0] if len(logits) == 1 else torch.cat(logits)


def _rows_of(tables, rows: range):
    """The chunk's rows (consecutive requests) of one table, or of each table of a
    layer -> table mapping (layers that shared one table object still share one)."""
    if not isinstance(tables, dict):
        return tables[rows.start:rows.stop]
    by_id = {id(t): t[rows.start:rows.stop] for t in tables.values()}
    return {name: by_id[id(t)] for name, t in tables.items()}


def split_pass(inputs: PassInputs, max_tokens: int, max_reqs: int | None = None):
    """Yield (chunk, request_rows) with at most `max_tokens` tokens (and `max_reqs`
    requests) each; request_rows is a range of consecutive requests (the chunk's rows are
    consecutive tokens).

    A request's query tokens may be split across chunks, in order. A piece holding query
    tokens [a, b) of a request whose query is [s, e) keeps the request's compacted row up
    to b: seq_len' = seq_len - (e - b). Causal masking is bottom-right aligned, so token i
    attends to the same compacted entries [0, seq_len - (e - i)] as in the unsplit pass,
    and the KV of [s, a) was written by an earlier chunk. `sample_rows` must be ascending.
    Example, max_tokens 4, two requests with queries of 3 and 5 tokens (rows 0-2, 3-7):
    chunks hold rows {0-2, 3}, {4-7}; the second request's seq_len drops by 4 in chunk 1.
    """
    if inputs.num_tokens <= max_tokens and (max_reqs is None
                                            or len(inputs.seq_lens) <= max_reqs):
        yield inputs, range(len(inputs.seq_lens))
        return
    assert all(a < b for a, b in zip(inputs.sample_rows[:-1], inputs.sample_rows[1:]))
    pieces: list[tuple[int, int, int]] = []  # (request, first row, end row)
    room = max_tokens
    qsl = inputs.query_start_loc
    for r in range(len(qsl) - 1):
        a, e = qsl[r], qsl[r + 1]
        if pieces and max_reqs is not None and r - pieces[0][0] == max_reqs:
            yield _chunk(inputs, pieces)
            pieces, room = [], max_tokens
        while a < e:
            if room == 0:
                yield _chunk(inputs, pieces)
                pieces, room = [], max_tokens
            b = min(e, a + room)
            pieces.append((r, a, b))
            room -= b - a
            a = b
    if pieces:
        yield _chunk(inputs, pieces)


def _chunk(inputs: PassInputs, pieces) -> tuple[PassInputs, range]:
    """The pass of `pieces` [(request, first row, end row)], consecutive rows of `inputs`."""
    first, end = pieces[0][1], pieces[-1][2]
    lens = [b - a for _, a, b in pieces]
    seq_lens = [inputs.seq_lens[r] - (inputs.query_start_loc[r + 1] - b) for r, _, b in pieces]
    sample_rows = [s - first for s in inputs.sample_rows if first <= s < end]
    chunk = PassInputs.make([0, *itertools.accumulate(lens)], seq_lens, sample_rows,
                            input_ids=inputs.input_ids[first:end],
                            positions=inputs.positions[first:end],
                            slot_mapping=inputs.slot_mapping[first:end])
    if inputs.kv_positions is not None:
        chunk.kv_positions = inputs.kv_positions[first:end]
    return chunk, range(pieces[0][0], pieces[-1][0] + 1)
