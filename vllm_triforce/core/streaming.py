"""The small draft's StreamingLLM cache: sink blocks + a window of recent blocks.

Table: the draft attends to its first `num_sink_blocks` blocks and the last
`num_window_blocks` blocks of the request (the last one possibly partial), read in
place from its paged KV cache through a compacted block table, like the middle level.
A request with at most sinks + window blocks gets its full table.

Position scheme. The draft (e.g. a 68M model trained on 2K positions) must never see
a position beyond its trained context, however long the request. vLLM caches keys
after RoPE, so a cached key keeps the position it was written with; attention only
depends on the distance between query and key positions, so all keys of the window
must have been written with one consistent shift. We therefore give each request a
`rebase_offset` and let the draft see, for absolute position p,

    draft position = p                   if p < sink_tokens (the sinks never move)
                     p - rebase_offset   otherwise.

Initially rebase_offset = 0. When the next pass would reach draft position
max_draft_position (`needs_rebase`), the engine rebases: with w = `window_start`
(first token of the current window), rebase_offset = w - sink_tokens, so the window
restarts right after the sinks, and the engine re-runs the draft over the window's
tokens at their new positions (rewriting their KV; a window of W blocks costs one
W * block_size-token draft prefill every ~(max_draft_position - sink_tokens - window)
tokens). New tokens are then written with the new offset. Between rebases the window
slides and draft positions grow by one per token, leaving a gap after the sinks, as
in StreamingLLM's "positions within the cache" idea but without re-rotating keys each
step. Worked example: block_size 32, 1 sink block (sink_tokens 32), 4 window blocks,
max_draft_position 256. At seq_len 250 the draft positions are the absolute ones.
A pass needing position 256 triggers a rebase: window_start(256) = 256 - 4*32 = 128
(the window is blocks 4..7, block 8 not yet started), offset = 128 - 32 = 96, so
absolute 128..255 re-run as 32..159 and the new token 256 gets draft position 160.
The next rebase comes at absolute position 352.

Requirement (checked by DraftWindow): sink_tokens + (num_window_blocks + 1) *
block_size + lookahead <= max_draft_position, where lookahead bounds the tokens one
pass adds. Right after a rebase the highest draft position is below sink_tokens +
num_window_blocks * block_size + lookahead; the extra block guarantees at least a
block of progress before the next rebase (the window start moves by whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftWindow:
    """The draft's window geometry and the position scheme of the module docstring.

    A request's `rebase_offset` is its own state (the engine keeps it per request); these
    methods take it and return the new one."""
    num_sink_blocks: int
    num_window_blocks: int
    block_size: int
    max_draft_position: int  # positions must stay < this (max_position_embeddings)
    lookahead: int = 16  # most tokens one draft pass adds beyond seq_len (gamma + bonus)

    def __post_init__(self):
        if self.num_sink_blocks < 0 or self.num_window_blocks < 1 or self.block_size < 1:
            raise ValueError("DraftWindow needs num_sink_blocks >= 0, num_window_blocks >= 1, "
                             "block_size >= 1")
        if self.num_tokens_needed > self.max_draft_position:
            raise ValueError(
                f"draft window does not fit the draft's context: {self.sink_tokens} sink tokens + "
                f"{self.num_window_blocks + 1} blocks of {self.block_size} (window + the block "
                f"being filled) + lookahead {self.lookahead} = {self.num_tokens_needed} > "
                f"max_draft_position {self.max_draft_position}; use fewer sink/window blocks")

    @property
    def sink_tokens(self) -> int:
        return self.num_sink_blocks * self.block_size

    @property
    def num_tokens_needed(self) -> int:
        """Draft positions the scheme needs: sinks + window + the block being filled + lookahead."""
        return self.sink_tokens + (self.num_window_blocks + 1) * self.block_size + self.lookahead

    # Per request, in Python ints (the host's side of the scheme; the functions below do
    # the same over tensors).
    def needs_rebase(self, max_position: int, rebase_offset: int) -> bool:
        return self.position(max_position, rebase_offset) >= self.max_draft_position

    def window_start(self, seq_len: int) -> int:
        num_blocks = -(-seq_len // self.block_size)
        first_block = max(num_blocks - self.num_window_blocks, self.num_sink_blocks)
        return first_block * self.block_size

    def position(self, position: int, rebase_offset: int) -> int:
        """The draft position of absolute `position` (module docstring)."""
        return position if position < self.sink_tokens else position - rebase_offset

    def rebase(self, seq_len: int) -> tuple[int, int]:
        """(first token of the window, new rebase_offset) for a request of seq_len tokens:
        the engine re-runs the draft from that token to seq_len at the new positions."""
        start = self.window_start(seq_len)
        return start, max(start - self.sink_tokens, 0)

    def table_columns(self, seq_lens: np.ndarray,
                      max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """The draft's table, as columns of the block table: ([n, sinks + window] the
        block-table column each entry of a request's compacted row reads, -1 past its
        blocks; [n] the compacted rows' tokens) for requests of seq_lens [n] tokens in a
        block table `max_blocks` columns wide: request r's row is block_table[r,
        columns[r]] where columns[r] >= 0, its sink blocks then the last num_window_blocks
        blocks (the last one possibly partial). Example, block_size 4, 1 sink and 2 window
        blocks: 13 tokens (blocks 0..3) -> [0, 2, 3] and 9 tokens (4 + 4 + 1); 6 tokens ->
        [0, 1, -1] and 6."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        num_blocks = -(-lens // self.block_size)  # [n]
        first = np.maximum(num_blocks - self.num_window_blocks, self.num_sink_blocks)  # [n]
        slot = np.arange(self.num_sink_blocks + self.num_window_blocks)  # [W]
        columns = np.where(slot < self.num_sink_blocks, slot,
                           first[:, None] + slot - self.num_sink_blocks)  # [n, W]
        columns[(columns >= num_blocks[:, None]) | (columns >= max_blocks)] = -1
        compact = (np.minimum(lens, self.sink_tokens)
                   + np.maximum(lens - first * self.block_size, 0))
        return columns, compact


def draft_positions(positions: Tensor, rebase_offset: Tensor, sink_tokens: int) -> Tensor:
    """The position the draft sees for absolute position p (module docstring).

    rebase_offset broadcasts against positions: [R] for positions [R, T], or already
    expanded per token (e.g. repeat_interleave by query lengths) for flattened [N].
    """
    rebase_offset = torch.as_tensor(rebase_offset, device=positions.device, dtype=positions.dtype)
    return torch.where(positions < sink_tokens, positions, positions - rebase_offset)


def needs_rebase(max_position: Tensor, rebase_offset: Tensor, sink_tokens: int,
                 max_draft_position: int) -> Tensor:
    """bool [R]: the largest absolute position of the next pass would map to a draft
    position >= max_draft_position under the current offset."""
    seen = draft_positions(max_position.long(), rebase_offset.to(max_position.device).long(),
                           sink_tokens)
    return seen >= max_draft_position
