"""Every bound of a middle pass's shape over persistent buffers, decided once (no vLLM
import: the memory plan reads it before any engine exists, engine/buffers.py
`round_graph_bytes`). engine/device/round_graph.py runs the passes."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Token buckets of a round's pass (two levels: one token per drafting request; three:
# up to gamma1 + 1), capped at the bounds' largest.
ROUND_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Largest bucket: rounds of more tokens take today's path (a serving batch of 256
# requests drafting alone, 128 with gamma1 = 1).
MAX_ROUND_TOKENS = 256
# Backends whose metadata vLLM captures in FULL CUDA graphs whatever the batch
# (AttentionCGSupport.ALWAYS) and whose tables TriForce swaps per layer (forward.SWAP_TABLE):
# the middle passes run as CUDA graphs there (round_graph.RoundGraphs.path).
GRAPH_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


@dataclass(frozen=True)
class RoundBounds:
    """Every bound of a middle pass's shape, decided once (`of`).

    Width: a row holds its selection (at most `max_selected` blocks) and its tail, from the
    tail's start at the last selection through the block of its newest token; between
    selections the tail grows by the tokens since (at most the refresh interval, or one
    step's gamma2 + gamma1 + 1 more while middle rounds run). With `refresh_interval` 0
    (select once) the tail grows without bound: such rows outgrow `max_width` in time and
    take today's path."""
    max_tokens: int        # the largest bucket
    max_requests: int      # request rows of the largest bucket
    max_width: int         # blocks in a compacted row
    max_query_len: int     # gamma1 + 1
    block_size: int
    buckets: tuple[int, ...]

    @classmethod
    def of(cls, budget_blocks: int, block_size: int, gamma1: int, gamma2: int,
           refresh_interval: int, drafting: int, max_blocks: int,
           max_batched_tokens: int) -> "RoundBounds":
        per_request = gamma1 + 1
        max_tokens = min(MAX_ROUND_TOKENS, drafting * per_request, max_batched_tokens)
        buckets = tuple(b for b in ROUND_BUCKETS if b < max_tokens) + (max_tokens,)
        growth = max(refresh_interval, 1) + gamma2 + per_request  # tokens past a selection
        width = min(max_blocks, budget_blocks + -(-growth // block_size) + 1)
        return cls(max_tokens, min(drafting, max_tokens), width, per_request, block_size,
                   buckets)

    @classmethod
    def of_draft(cls, table_blocks: int, block_size: int, gamma1: int, gamma2: int,
                 drafting: int, max_batched_tokens: int) -> "RoundBounds":
        """The small draft's passes (engine/draft_level.py): one StreamingLLM table of
        `table_blocks` blocks for every layer; a request runs its pending tokens first (in
        a step after a drafting one, the tokens vLLM accepted and its own: at most
        gamma2 + gamma1 + 1), then one token a step. A longer pending run (after a plain
        stretch, a rebase or the sinks' first pass) takes today's path."""
        per_request = gamma2 + gamma1 + 1
        max_tokens = min(MAX_ROUND_TOKENS, drafting * per_request, max_batched_tokens)
        buckets = tuple(b for b in ROUND_BUCKETS if b < max_tokens) + (max_tokens,)
        return cls(max_tokens, min(drafting, max_tokens), table_blocks, per_request,
                   block_size, buckets)

    @property
    def max_seq_len(self) -> int:
        return self.max_width * self.block_size

    def bucket(self, num_tokens: int, width: int, max_query_len: int = 1) -> int | None:
        """The bucket of a pass of `num_tokens` tokens over rows `width` blocks wide whose
        longest query is `max_query_len` tokens (None: it fits none: a graph freezes the
        longest query its kernels were chosen for)."""
        if (num_tokens > self.max_tokens or width > self.max_width
                or max_query_len > self.max_query_len):
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def requests_of(self, bucket: int) -> int:
        return min(bucket, self.max_requests)
