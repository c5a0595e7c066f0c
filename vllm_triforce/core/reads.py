"""How the policies read a summary store without copying all of it at once.

Scoring reads stores [L, N, H, D] (per-block key sums, deviations: coded in one byte a
value in the engine, core/summary_coding.py `CodedStore`, or bf16 / float32 tensors) as
float32. Read whole, every physical block's rows or every table block of a long request
would be copied at once; instead each read takes one "read chunk" of the block axis
(`block_chunks`, `score_chunks`) or of a table's axis (`gather_chunks`), whose float32
copy is at most `read_limit` bytes. `rows_dot` then multiplies the rows read in
place, without copying them again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vllm_triforce.core.summary_coding import CodedStore

# Scoring every physical block ("all" strategies) reads the summary store [L, N, H, D] in
# chunks of blocks, each cast to float32 on its own: with bf16 summaries a whole-store
# float32 copy would be twice the store (~4 GB for a 60 GB KV cache) at every selection.
SCORE_CHUNK_BYTES = 64 * 2**20


def read_limit(summaries) -> int:
    """The most one chunked read of `summaries` (or of the keys they summarise) copies:
    SCORE_CHUNK_BYTES, or the smaller read chunk the engine's memory plan sized for a small
    cache (`BlockSummaries.chunk_bytes`, engine/memory.py)."""
    chunk_bytes = getattr(summaries, "chunk_bytes", None)
    return SCORE_CHUNK_BYTES if chunk_bytes is None else min(SCORE_CHUNK_BYTES, chunk_bytes)


def block_chunks(store: Tensor, limit: int | None = None) -> list[slice]:
    """Slices of the store's block axis whose float32 copy (all layers, heads and channels)
    takes at most `limit` (None: SCORE_CHUNK_BYTES), or one block when a block alone takes
    more. Example: L=32, H=8, D=128 -> 128 KiB per block in float32 -> 512 blocks per chunk."""
    num_blocks = store.shape[1]
    block_bytes = block_values(store) * 4  # float32
    per_chunk = max(1, (limit or SCORE_CHUNK_BYTES) // max(1, block_bytes))
    return [slice(start, start + per_chunk) for start in range(0, num_blocks, per_chunk)]


def gather_chunks(store: Tensor, ids: Tensor, limit: int | None = None) -> list[slice]:
    """Slices of the table axis of ids [R, B] whose gathered float32 copy (every request's
    blocks, all layers, heads and channels) takes at most `limit` (None: SCORE_CHUNK_BYTES,
    the one in this example). Example:
    Llama-3.1-8B (L=32, H=8, D=128), one 128K request (B=8,192): 512 blocks per chunk,
    64 MiB each, where one gather would copy 1 GiB."""
    column_bytes = block_values(store) * 4 * max(1, ids.shape[0])  # float32
    per_chunk = max(1, (limit or SCORE_CHUNK_BYTES) // max(1, column_bytes))
    return [slice(start, start + per_chunk) for start in range(0, ids.shape[1], per_chunk)]


def block_values(store: Tensor | CodedStore) -> int:
    """Values one block holds in a store [L, N, H, D]: L x H x D."""
    return math.prod(store.shape) // store.shape[1]


def gathered(store: Tensor | CodedStore, ids: Tensor) -> Tensor:
    """store [L, N, H, D] at ids [R, b] -> [L, R, b, H, D] float32 (`index_select`, the
    faster of the two gathers of the block axis on a CPU; advanced indexing is the other)."""
    if isinstance(store, CodedStore):
        return store.gather(ids.flatten()).unflatten(1, ids.shape)
    return store.index_select(1, ids.flatten()).float().unflatten(1, ids.shape)


def block_slice(store: Tensor | CodedStore, chunk: slice) -> Tensor:
    """store [L, N, H, D] at a slice of the block axis -> [L, s, H, D] float32."""
    if isinstance(store, CodedStore):
        return store.blocks(chunk)
    return store[:, chunk].float()


def flat_rows(store: Tensor | CodedStore, rows: Tensor) -> Tensor:
    """rows [n] of store [L, N, H, D] viewed as [L * N, H * D] -> [n, H * D]: the store's
    element (a tensor store), or float32 (a coded one)."""
    if isinstance(store, CodedStore):
        return store.rows(rows).flatten(1)
    return store.view(store.shape[0] * store.shape[1], -1).index_select(0, rows)


def rows_dot(weights: Tensor, rows: Tensor) -> Tensor:
    """weights [R, L, K] . rows [R, L, S, K] (any strides) -> [R, L, S]: one batched
    vector-matrix product over a transposed view, no copy of `rows` (on a CPU faster than
    the matrix-vector products an einsum makes of it at a middle round's sizes)."""
    num_reqs, num_layers, num_rows, channels = rows.shape
    batch = num_reqs * num_layers
    dots = torch.bmm(weights.reshape(batch, 1, channels),
                     rows.reshape(batch, num_rows, channels).transpose(1, 2))
    return dots.view(num_reqs, num_layers, num_rows)


def score_chunks(store: Tensor, limit: int | None = None) -> list[slice]:
    """`block_chunks`, except that a float32 store is read in place, whole (its `.float()`
    copies nothing), so float32 scores stay what one product gives."""
    return [slice(None)] if store.dtype == torch.float32 else block_chunks(store, limit)
