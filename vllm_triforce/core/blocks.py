"""Block geometry shared by selection and the policies: sinks, candidates, tail.

Terms (one vLLM block = one retrieval chunk; "logical block" = index in a request's
block table). A request has `num_committed` tokens with exact KV, n_full of its
blocks are full.

Counts come as a `config.BlockCounts` (block_size, retrieval_sink_blocks,
retrieval_recent_blocks, budget_blocks), the one geometry every caller passes; it states
the bounds too (num_retrieved, max_chosen, max_selected, the smallest budget).

  sinks       logical [0, num_sinks): always attended (attention sinks). Only full
              blocks count, so num_sinks = min(retrieval_sink_blocks, n_full).
  tail        logical [tail_start, end): always attended; the last retrieval_recent_blocks
              full blocks, the partial block and every token appended after the
              selection (between refreshes new tokens simply extend the tail).
              tail_start = max(n_full - retrieval_recent_blocks, num_sinks).
  candidates  logical [num_sinks, tail_start): the full blocks a policy scores.

Worked example, block_size 4, 2 sink blocks, 1 recent block, num_committed 22:
n_full = 5, blocks 0..5 (block 5 holds 2 tokens). sinks = {0, 1}, tail_start =
max(5 - 1, 2) = 4, so the tail is blocks 4, 5 and the candidates are blocks 2, 3.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from vllm_triforce.config import BlockCounts

PAD = -1  # a slot of a list of logical or physical blocks that holds no block


def candidate_bounds(num_committed: Tensor, blocks: BlockCounts) -> tuple[Tensor, Tensor]:
    """([R] num_sinks: sink blocks actually present (a sink must be a full block),
    [R] tail_start: first logical block of the contiguous tail); the candidates are
    logical [num_sinks, tail_start). Four device operations; callers that need both (and
    the mask) compute them once."""
    n_full = num_committed.long() // blocks.block_size
    sinks = n_full.clamp(max=blocks.retrieval_sink_blocks)
    return sinks, torch.maximum(n_full - blocks.retrieval_recent_blocks, sinks)


def selection_sizes(num_committed, blocks: BlockCounts):
    """(num_selected, tail_start) that `core/selection.select_blocks` gives a request of
    num_committed tokens, on the host: Python ints for an int, [R] int64 arrays for an
    array of requests (one numpy pass over a batch, no call per request). The host sizes a
    pass from them without reading the device's Selection back. Same rules as
    candidate_bounds above; the retrieved count is every candidate when the request fits
    the budget, else num_retrieved."""
    committed = np.asarray(num_committed, dtype=np.int64)
    n_full = committed // blocks.block_size
    sinks = np.minimum(n_full, blocks.retrieval_sink_blocks)
    start = np.maximum(n_full - blocks.retrieval_recent_blocks, sinks)
    num_candidates = start - sinks
    total_blocks = -(-committed // blocks.block_size)
    retrieved = blocks.num_retrieved
    dense = (total_blocks <= blocks.budget_blocks) | (num_candidates <= retrieved)
    num_selected = sinks + np.where(dense, num_candidates, retrieved)
    if committed.ndim == 0:
        return int(num_selected), int(start)
    return num_selected, start


def candidate_mask(num_committed: Tensor, max_blocks: int, blocks: BlockCounts,
                   bounds: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """[R, max_blocks] bool: logical block j is a selection candidate of request r.
    `bounds`: `candidate_bounds(num_committed, blocks)` where the caller has them."""
    first, end = bounds or candidate_bounds(num_committed, blocks)  # [R] each
    j = torch.arange(max_blocks, device=num_committed.device)  # [max_blocks]
    return (j >= first[:, None]) & (j < end[:, None])


def full_block_mask(num_committed: Tensor, block_size: int, max_blocks: int) -> Tensor:
    """[R, max_blocks] bool: logical block j is full of committed tokens."""
    j = torch.arange(max_blocks, device=num_committed.device)
    return j < (num_committed.long() // block_size)[:, None]
