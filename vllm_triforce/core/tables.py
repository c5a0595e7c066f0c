"""What vLLM's attention metadata takes from a selection: one block table and one sequence
length per layer and request. No KV is copied: the compacted table points at the target's
own physical blocks.

Compacted row layout (why the tail goes last): vLLM's attention aligns the query
tokens bottom-right against the row's keys (key i of a row of length n is visible to
query token t of q_len tokens iff i <= n - q_len + t). Keys keep their RoPE
positions, so order among the *selected* blocks does not matter, but the newest
tokens must be the last keys of the row for the causal mask to stay right. Hence
[selected blocks in position order][tail blocks up to seq_len]. Example, block_size
4, sinks {0}, selected {3}, tail_start 6, seq_len 31 (block 6 full, block 7 holding 3
tokens): row = [b0, b3, b6, b7], compact_seq_len = 2*4 + (31 - 6*4) = 15.

Between refreshes the tail simply grows: a pass's rows reach its last token, so a table
may hold up to budget + (tokens since the selection) / block_size blocks; the budget is
only enforced at selection time.

One way to the tables, `laid_out_tables`, from each row's sizes. The engine
(`RetrievalStep.forward`) works the sizes out on the host, which already knows them
(`TableLayout`, from core/blocks.selection_sizes: no host list as wide as the tables);
`build_block_tables` / `compact_tables` (tools/bench/, the teacher, the tests) work them out on
the device from a `selection.Selection` and the rows' lengths, then call it too. So what
the benchmarks measure is what the engine attends with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_triforce.core.blocks import PAD
from vllm_triforce.core.selection import Selection
from vllm_triforce.core.tensors import on_device


def build_block_tables(selection: Selection, block_table: Tensor, seq_lens: Tensor, block_size: int,
                       width: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-layer compacted block tables: selected blocks in position order, then the tail.

    block_table [num_reqs, max_blocks] physical ids; seq_lens [num_reqs] tokens INCLUDING
    the query tokens of the pass about to run (the tail extends to seq_len).
    Returns tables [num_layers, num_reqs, width] int32 (padded with 0; width defaults to
    max_blocks, always enough) and compact_seq_lens [num_layers, num_reqs] int32 =
    num_selected * block_size + (seq_len - tail_start * block_size).
    """
    device = block_table.device
    tables = compact_tables(selection, block_table, seq_lens, block_size, width)
    num_layers = tables.shape[0]
    num_selected = on_device(selection.num_selected, device)
    start = on_device(selection.tail_start, device)
    compact = (num_selected - start) * block_size + on_device(seq_lens, device, torch.long)  # [R]
    return tables, compact.to(torch.int32).expand(num_layers, -1).contiguous()


def compact_tables(selection: Selection, block_table: Tensor, seq_lens: Tensor,
                   block_size: int, width: int | None = None) -> Tensor:
    """`build_block_tables`' tables alone ([num_layers, num_reqs, width] int32): the engine's
    `laid_out_tables`, with each row's tail length worked out on the device from `seq_lens`
    instead of by the host (`TableLayout`)."""
    device = block_table.device
    tail_start = on_device(selection.tail_start, device, torch.long)
    num_blocks = (on_device(seq_lens, device, torch.long) + block_size - 1) // block_size
    return laid_out_tables(on_device(selection.logical_blocks, device, torch.long), block_table,
                           on_device(selection.num_selected, device, torch.long), tail_start,
                           num_blocks - tail_start, width or block_table.shape[1])


@dataclass
class TableLayout:
    """The sizes of a pass's compacted rows, worked out on the host from what it knows
    (`core/blocks.selection_sizes`), so the device lays the tables out with a few
    operations whatever the batch and width (`laid_out_tables`). Row i: slots
    [0, num_selected[i]) are its selection's first blocks, then its num_tails[i] tail
    blocks tail_start[i], ... through the block holding its last token, then padding."""
    width: int               # slots of the widest row
    num_selected: list[int]  # [R]
    tail_start: list[int]    # [R] the tail's first logical block
    num_tails: list[int]     # [R]
    compact_lens: list[int]  # [R] tokens in each compacted row

    @classmethod
    def of(cls, num_selected: list[int], tail_start: list[int], seq_ends: list[int],
           block_size: int) -> "TableLayout":
        """Example, block_size 4: one row of 2 selected blocks, tail from block 5, 23 tokens
        (blocks 5 to 5) -> width 3, num_tails [1], compact length 2 * 4 + 23 - 20 = 11."""
        n, t = np.asarray(num_selected, np.int64), np.asarray(tail_start, np.int64)
        end = np.asarray(seq_ends, np.int64)
        num_tails = -(-end // block_size) - t
        return cls(int((n + num_tails).max()), n.tolist(), t.tolist(), num_tails.tolist(),
                   ((n - t) * block_size + end).tolist())


def laid_out_tables(selected: Tensor, block_table: Tensor, num_selected: Tensor,
                    tail_start: Tensor, num_tails: Tensor, width: int) -> Tensor:
    """The compacted tables from a `TableLayout` (its per-row sizes on the device, [R] each):
    selected [R, L, max_selected] logical blocks (a Selection's), block_table [R, max_blocks]
    physical ids -> [L, R, width] int32, padding 0. A dozen operations whatever R, L and
    width; no host list as long as the tables."""
    phys = table_rows(selected, block_table, num_selected, tail_start, num_tails,
                      torch.arange(width, device=selected.device))
    return phys.transpose(0, 1).to(torch.int32).contiguous()


def table_rows(selected: Tensor, block_table: Tensor, num_selected: Tensor,
               tail_start: Tensor, num_tails: Tensor, columns: Tensor) -> Tensor:
    """`laid_out_tables`' rows [R, L, W] (block_table's dtype, padding 0), W columns given
    as columns = arange(W) [W]: every size comes from a tensor's, none from a host int, so
    compiled it serves every size (engine/device/round_graph.py `pass_layout`)."""
    num_reqs, num_layers, max_selected = selected.shape
    offset = columns - num_selected[:, None]  # [R, W]
    tail = (offset + tail_start[:, None]).masked_fill_(offset >= num_tails[:, None], PAD)
    # column c < num_selected <= max_selected is the selection's c-th block; the others
    # take the tail, so the clamped columns' blocks are never kept
    head = selected.gather(-1, columns.clamp(max=max_selected - 1).expand(num_reqs,
                                                                           num_layers, -1))
    logical = torch.where((offset < 0)[:, None, :], head, tail[:, None, :])  # [R, L, W]
    phys = block_table.gather(1, logical.clamp(min=0).flatten(1)).view_as(logical)
    return phys.masked_fill(logical < 0, 0)
