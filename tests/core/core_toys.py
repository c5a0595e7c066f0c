"""Toy inputs shared by the core tests: random committed keys in a paged store."""

from __future__ import annotations

import torch

from vllm_triforce.core.summaries import BlockSummaries


def random_block_table(lengths, block_size, num_blocks, max_blocks, gen):
    """[R, max_blocks] int32: distinct random physical blocks per request, 0-padded."""
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lengths):
        nb = -(-n // block_size)
        table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    return table


def make_pool(lengths, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, keep_keys=True,
              seed=0, chunk=5, keep_bounds=True, keep_variance=False, compact_variance=False,
              coded=False):
    """Requests of the given committed lengths written to BlockSummaries in chunks of
    `chunk` tokens per pass, each pass also carrying 2 speculative (uncommitted) rows.
    Returns (summaries, block_table [R, max_blocks], keys: list of [L, n, H, D])."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    table = random_block_table(lengths, block_size, num_blocks, max_blocks, gen)
    summaries = BlockSummaries(num_layers, num_blocks, num_kv_heads, head_dim, block_size,
                               keep_keys=keep_keys, keep_bounds=keep_bounds,
                               keep_variance=keep_variance, compact_variance=compact_variance,
                               coded=coded)
    keys = [torch.randn(num_layers, n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    for r, n in enumerate(lengths):
        for lo in range(0, n, chunk):
            write_pass(summaries, keys[r][:, lo:lo + chunk], table[r], lo, block_size, gen)
    return summaries, table, keys


def write_pass(summaries, committed, table_row, first_pos, block_size, gen, num_spec=2):
    """One forward pass: committed [L, n, H, D] keys at positions first_pos.. followed
    by num_spec speculative rows (garbage keys, not committed). Flattened [T, H*D]."""
    num_layers, n, heads, dim = committed.shape
    spec = 1e3 * torch.randn(num_layers, num_spec, heads, dim, generator=gen)
    layer_keys = [torch.cat([committed[l], spec[l]]).reshape(n + num_spec, heads * dim)
                  for l in range(num_layers)]
    pos = torch.arange(first_pos, first_pos + n)
    summaries.add_committed(layer_keys, torch.arange(n), table_row.long()[pos // block_size],
                            pos % block_size)


def geometry(block_size: int, budget_blocks: int, sinks: int, recent: int):
    """config.BlockCounts of a retrieval selection (the draft's counts left at defaults)."""
    from vllm_triforce.config import BlockCounts

    return BlockCounts(block_size=block_size, budget_blocks=budget_blocks,
                       retrieval_sink_blocks=sinks, retrieval_recent_blocks=recent)
