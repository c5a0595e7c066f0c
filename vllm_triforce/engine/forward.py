"""Run a model over block tables the proposer chose: the only code that builds attention metadata.

Depends on vLLM 0.32.0: `CommonAttentionMetadata` (vllm/v1/attention/backend.py),
`AttentionGroup.build_metadata` (vllm/v1/worker/utils.py) and `set_forward_context`
(vllm/forward_context.py). Each attention layer looks up its own metadata by name, so a
different block table per layer needs no kernel change: the stock backend attends over
exactly the blocks listed, with causal masking bottom-right aligned on the compacted row
(the query tokens are always the last tokens of each row, VLLM_INTERNALS Appendix A).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata


@dataclass
class PassInputs:
    """One forward pass over a batch of requests (host-built, then moved to the device)."""
    input_ids: torch.Tensor        # [num_tokens] int32
    positions: torch.Tensor        # [num_tokens] int64: positions the model rotates with
    slot_mapping: torch.Tensor     # [num_tokens] int64: TRUE KV slots the tokens write to
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor         # [num_reqs] int32: tokens in each COMPACTED row
    sample_rows: torch.Tensor      # [num_samples] int64: token rows whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_common(inputs: PassInputs, block_table: torch.Tensor, device) -> CommonAttentionMetadata:
    qsl_cpu = inputs.query_start_loc.to(torch.int32)
    seq_lens_cpu = inputs.seq_lens.to(torch.int32)
    q_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    return CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device),
        num_reqs=int(seq_lens_cpu.shape[0]),
        num_actual_tokens=inputs.num_tokens,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=block_table.to(device=device, dtype=torch.int32),
        slot_mapping=inputs.slot_mapping.to(device),
        causal=True,
        seq_lens_cpu_upper_bound=seq_lens_cpu,
    )


def _own_block_table(meta):
    """Metadata built through a group whose kernel block size differs from the manager's
    points into one shared per-group buffer; give each layer its own copy."""
    if dataclasses.is_dataclass(meta) and hasattr(meta, "block_table"):
        return dataclasses.replace(meta, block_table=meta.block_table.clone())
    return meta


def layer_metadata(groups, inputs: PassInputs, tables: torch.Tensor | list, device) -> dict:
    """Metadata per layer name. `tables` is one [num_reqs, width] table for every layer,
    or a mapping layer_name -> table."""
    metas = {}
    for group in groups:
        shared = None
        for name in group.layer_names:
            if isinstance(tables, dict) and name not in tables:
                continue  # a layer of another model sharing the KV-cache group
            table = tables[name] if isinstance(tables, dict) else tables
            if shared is None or isinstance(tables, dict):
                meta = group.build_metadata(build_common(inputs, table, device))
                if group.kernel_block_size is not None:
                    meta = _own_block_table(meta)
                shared = meta
            metas[name] = shared
    return metas


def run(model, vllm_config, metas: dict, inputs: PassInputs, device) -> torch.Tensor:
    """Forward `model` over `inputs` with per-layer `metas`; returns logits of sample_rows.

    The compiled model on CUDA asserts `num_tokens <= max_num_batched_tokens`
    (vllm/compilation/piecewise_backend.py, 0.32.0); CPU has no such check, so we assert it
    here and every caller goes through `run_pass`, which splits larger passes."""
    limit = vllm_config.scheduler_config.max_num_batched_tokens
    assert inputs.num_tokens <= limit, (
        f"TriForce pass of {inputs.num_tokens} tokens exceeds max_num_batched_tokens={limit}")
    slots = inputs.slot_mapping.to(device)
    with set_forward_context(metas, vllm_config, num_tokens=inputs.num_tokens,
                             slot_mapping={name: slots for name in metas}):
        hidden = model(input_ids=inputs.input_ids.to(device),
                       positions=inputs.positions.to(device),
                       intermediate_tensors=None, inputs_embeds=None)
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    return model.compute_logits(hidden[inputs.sample_rows.to(device)])


def run_pass(model, vllm_config, groups, inputs: PassInputs, tables, device,
             stats=None) -> torch.Tensor:
    """Build metadata and forward, in chunks of at most max_num_batched_tokens tokens.

    `tables`: one [num_reqs, width] table for every layer, or layer_name -> table.
    Returns the logits of `inputs.sample_rows`, in order. With `stats`, the device-synced
    forward time goes to `stats.forward_seconds` (the rest of the proposer is host work)."""
    start = time.perf_counter()
    limit = vllm_config.scheduler_config.max_num_batched_tokens
    logits = []
    chunks = list(split_pass(inputs, limit))
    for chunk, rows in chunks:
        chunk_tables = ({n: t[rows] for n, t in tables.items()} if isinstance(tables, dict)
                        else tables[rows])
        metas = layer_metadata(groups, chunk, chunk_tables, device)
        logits.append(run(model, vllm_config, metas, chunk, device))
    out = logits[0] if len(logits) == 1 else torch.cat(logits)
    if stats is not None:
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        stats.add(forward_seconds=time.perf_counter() - start,
                  split_passes=int(len(chunks) > 1))
        stats.max_pass_tokens = max(stats.max_pass_tokens, *(c.num_tokens for c, _ in chunks))
    return out


def split_pass(inputs: PassInputs, max_tokens: int):
    """Yield (chunk, request_rows) with at most `max_tokens` tokens each.

    A request's query tokens may be split across chunks, in order. A piece holding query
    tokens [a, b) of a request whose query is [s, e) keeps the request's compacted row up
    to b: seq_len' = seq_len - (e - b). Causal masking is bottom-right aligned, so token i
    attends to the same compacted entries [0, seq_len - (e - i)] as in the unsplit pass,
    and the KV of [s, a) was written by an earlier chunk. `sample_rows` must be ascending.
    Example, max_tokens 4, two requests with queries of 3 and 5 tokens (rows 0-2, 3-7):
    chunks hold rows {0-2, 3}, {4-7}; the second request's seq_len drops by 4 in chunk 1.
    """
    if inputs.num_tokens <= max_tokens:
        yield inputs, torch.arange(inputs.query_start_loc.numel() - 1)
        return
    assert bool((inputs.sample_rows[1:] > inputs.sample_rows[:-1]).all())
    pieces: list[tuple[int, int, int]] = []  # (request, first row, end row)
    room = max_tokens
    qsl = inputs.query_start_loc.tolist()
    for r in range(len(qsl) - 1):
        a, e = qsl[r], qsl[r + 1]
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


def _chunk(inputs: PassInputs, pieces) -> tuple[PassInputs, torch.Tensor]:
    rows = torch.cat([torch.arange(a, b) for _, a, b in pieces])
    reqs = torch.tensor([r for r, _, _ in pieces])
    lens = torch.tensor([b - a for _, a, b in pieces])
    ends = inputs.query_start_loc[1:][reqs]
    seq_lens = inputs.seq_lens[reqs] - (ends - torch.tensor([b for _, _, b in pieces]))
    in_chunk = (inputs.sample_rows >= rows[0]) & (inputs.sample_rows <= rows[-1])
    chunk = PassInputs(input_ids=inputs.input_ids[rows], positions=inputs.positions[rows],
                       slot_mapping=inputs.slot_mapping[rows],
                       query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long),
                                                  lens.cumsum(0)]),
                       seq_lens=seq_lens, sample_rows=inputs.sample_rows[in_chunk] - rows[0])
    return chunk, reqs
