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
    """Forward `model` over `inputs` with per-layer `metas`; returns logits of sample_rows."""
    slots = inputs.slot_mapping.to(device)
    with set_forward_context(metas, vllm_config, num_tokens=inputs.num_tokens,
                             slot_mapping={name: slots for name in metas}):
        hidden = model(input_ids=inputs.input_ids.to(device),
                       positions=inputs.positions.to(device),
                       intermediate_tensors=None, inputs_embeds=None)
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    return model.compute_logits(hidden[inputs.sample_rows.to(device)])
