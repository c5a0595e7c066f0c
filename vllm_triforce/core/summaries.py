"""Per-block key summaries the selection policies score queries against.

Two summaries per (layer, physical block, KV head), both updated from committed keys:
- the running *sum* of the keys and a count (mean key: `retrieval`);
- optionally (`keep_bounds=True`, policy `quest`), the per-channel *minimum and maximum*
  of the keys (Quest, Tang et al. 2024): for any query q, sum_d max(q_d min_d, q_d max_d)
  is an upper bound of q . k over every key k of the block;
- optionally (`keep_variance=True`, `retrieval` with its key variance, the engine default),
  the sum of squared deviations of the keys from the block's mean, per channel (the
  variance times the count), combined pass by pass (Chan et al.'s parallel variance), so a
  score reads it as directly as the sums: no squared-mean term over many blocks; float32.
  Compact (`compact_variance=True`): the same sums added up over each of COMPACT_BANDS
  *bands* of a head's channels, in the summaries' dtype (bf16 in a bf16 engine, float32
  for float16, whose range a band's sum can pass): 8 values per KV head instead of
  head_dim float32s, 1/32 of the per-channel store at head_dim 128 in bf16.
- coded (`coded=True`, config `compact_summaries`): the key sums in float8 and the square
  deviations per channel in a one-byte log code, each row of a layer's, block's and KV
  head's channels with a float32 scale (core/summary_coding.py): a third of bf16 sums and
  float32 variances. A coded store is written whole blocks at a time: a fold reads the
  blocks it touches, adds its keys in float32 and codes them again (one rounding per
  pass that touches a block; a block set at once by `set_blocks` is coded once).

Bands. Channel d of a head of D channels is in band (d mod D/2) // (D / (2 x bands)): the
two halves of a head share their bands, so each band holds whole RoPE rotation pairs
(channels d and d + D/2 under vLLM's neox-style rotation; 2i and 2i + 1 under GPT-J's, a
band taking an even number of channels from each half) and, under the neox style, one
range of rotation frequencies. Example, D = 8, 2 bands: band 0 = channels 0, 1, 4, 5;
band 1 = 2, 3, 6, 7. A score weighs a band's M2 by its channels' weights, each in
proportion to that channel's share of the band's M2 over every block folded so far (the
*channel profile*, per layer and KV head: a head's outlier channels are its own, block
after block; `variance_weights`); exact when every block's M2 in a band splits among its
channels as the profile's does; before any block, by the channels' mean weight.

One vLLM KV block is one TriForce retrieval chunk. For every layer, KV head and
*physical* block we keep the running sum of the block's committed keys (post-RoPE,
exactly as written to the KV cache) and a count, so a block's mean key costs one
division. Updating as tokens are committed means a re-selection reads ~1/block_size
of the keys instead of all of them.

Committed only: speculative tokens may be rejected, so the engine calls
`add_committed` with only the rows whose tokens were accepted (their KV is exact).
A partially filled block therefore holds only committed keys, but the selection
never scores it anyway (it is always attended as part of the tail).

Lazily (`set_blocks`): a full block's summaries can also be computed at once from its
keys read back from the KV cache, the engine's default for blocks completed while decoding
(engine/summary_keeper.py; prompts are folded as computed): then a decode step that
selects nothing touches no summary.

Memory: the store is indexed by physical block id and shared by all requests, like
the KV cache itself, so blocks shared through prefix caching are summarised once.
It is sized once for the whole KV cache (`nbytes()` reports it: ~1/block_size of the
key cache for the sums, twice that again with the bounds; engine/memory.py reserves it
before vLLM sizes its cache) and nothing is freed per
request: a freed block is simply overwritten when it is reused, because the first token
written at offset 0 resets the block. Per-request state (selection, H2O accumulators) lives in
`scoring.SelectionState` and is dropped with the request.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_triforce.config import COMPACT_BANDS
from vllm_triforce.core.reads import flat_rows
from vllm_triforce.core.summary_coding import CodedStore, encode
from vllm_triforce.core.tensors import on_device


def variance_width(head_dim: int, compact: bool, bands: int = COMPACT_BANDS) -> int:
    """Values of key variance per KV head: head_dim (one per channel) or, compact, the
    most of `bands`, bands / 2, ..., 2 bands that take an even number of channels from
    each half of the head (whole rotation pairs, module docstring), else 1. Example: 128
    -> 8 bands of 16 channels; 80 -> 4 bands of 20; 12 -> 1 band."""
    if not compact:
        return head_dim
    if head_dim % 2:
        raise ValueError(f"a compact key variance needs an even head size, not {head_dim}")
    widths = [bands >> i for i in range(bands.bit_length()) if bands >> i >= 2]
    return next((b for b in widths if head_dim % (4 * b) == 0), 1)


def variance_dtype(dtype: torch.dtype, compact: bool) -> torch.dtype:
    """The key variance's element: float32 per channel; compact, the summaries' `dtype`
    where that is bfloat16 or float32 (a band's sum of squares can pass float16's range:
    16 keys of magnitude 20 in 16 channels already make 102,400)."""
    return dtype if compact and dtype in (torch.bfloat16, torch.float32) else torch.float32


def fold_bands(x: Tensor, width: int, reduce: str = "sum") -> Tensor:
    """x [..., D] per channel -> [..., width] per band (module docstring), by `reduce`
    ("sum" or "mean") over each band's channels; x itself when width == D."""
    head_dim = x.shape[-1]
    if width == head_dim:
        return x
    per_band = x.unflatten(-1, (2, width, head_dim // (2 * width)))  # [..., half, band, d]
    return per_band.sum((-3, -1)) if reduce == "sum" else per_band.mean((-3, -1))


def band_shares(profile: Tensor, width: int) -> Tensor:
    """profile [..., D] per-channel M2 totals -> [..., D] each channel's share of its
    band's total (module docstring); equal shares in a band whose total is 0."""
    head_dim = profile.shape[-1]
    per_band = profile.float().unflatten(-1, (2, width, head_dim // (2 * width)))
    per_band = per_band + torch.finfo(torch.float32).tiny  # an empty band: equal shares
    return (per_band / per_band.sum((-3, -1), keepdim=True)).flatten(-3)


def token_pieces(spans, limit: int, block_size: int = 1):
    """Spans (owner, first position, count) cut into lists of spans of at most `limit`
    tokens in all, in order. A span is cut only where a block of `block_size` positions
    ends (where a piece holds a whole block: limit >= block_size), so the tokens a span
    brings to one block are folded together whatever the limit: the summaries of a pass
    do not depend on the memory plan's read chunk (a coded store codes a block once per
    fold; the variance merges once). Examples, limit 4: [(0, 6, 3), (1, 0, 2)] ->
    [(0, 6, 3), (1, 0, 1)], [(1, 1, 1)]; block_size 4, limit 6: [(0, 6, 3), (1, 0, 9)] ->
    [(0, 6, 3)], [(1, 0, 4)], [(1, 4, 5)]."""
    align = block_size if limit >= block_size else 1
    piece, size = [], 0
    for owner, start, count in spans:
        while count:
            take = min(count, limit - size)
            if take < count:  # the span goes on in the next piece: cut where a block ends
                take = (start + take) // align * align - start
                if take <= 0:  # its next block does not fit this piece (an empty one holds it)
                    yield piece
                    piece, size = [], 0
                    continue
            piece.append((owner, start, take))
            size, start, count = size + take, start + take, count - take
            if size == limit or count:
                yield piece
                piece, size = [], 0
    if piece:
        yield piece


def committed_runs(owners, starts, counts, block_size: int):
    """Spans (owners[i] committed counts[i] tokens from position starts[i], each owner at
    most once) token by token, by array operations on the host: (positions, owners,
    run_of_token, num_runs) with one run per block a span touches, in order (a request's
    new tokens fill its own blocks in order; `BlockSummaries.add_committed` folds a run at
    once). Example, block size 4: owners [0, 1], starts [6, 0], counts [3, 2] ->
    positions [6, 7, 8, 0, 1], owners [0, 0, 0, 1, 1], runs [0, 0, 1, 2, 2], 3 runs."""
    owners, starts, counts = (np.asarray(a, dtype=np.int64) for a in (owners, starts, counts))
    owner = np.repeat(owners, counts)  # [T] each token's owner
    first = np.cumsum(counts) - counts  # each span's first token
    positions = np.repeat(starts, counts) + np.arange(owner.size) - np.repeat(first, counts)
    blocks = positions // block_size
    new_run = np.ones(owner.size, dtype=bool)
    new_run[1:] = (owner[1:] != owner[:-1]) | (blocks[1:] != blocks[:-1])
    return positions, owner, np.cumsum(new_run) - 1, int(new_run.sum())


class BlockSummaries:
    """Running sums of committed keys per (layer, physical block, KV head)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype = torch.float32, device=None,
                 keep_keys: bool = False, key_dtype: torch.dtype | None = None,
                 keep_bounds: bool = False, keep_variance: bool = False,
                 compact_variance: bool = False, coded: bool = False,
                 chunk_bytes: int | None = None):
        if min(num_layers, num_blocks, num_kv_heads, head_dim, block_size) <= 0:
            raise ValueError("BlockSummaries: all sizes must be positive")
        if coded and compact_variance:
            raise ValueError("BlockSummaries: a coded store keeps the variance per channel, "
                             "not per band (coded and compact_variance exclude each other)")
        # The most bytes one chunked read of these summaries (or of the keys they summarise)
        # may copy, where the engine's memory plan sized its scratch for a small cache
        # (engine/memory.py `Sizing.chunk_bytes`); None: reads.SCORE_CHUNK_BYTES.
        self.chunk_bytes = chunk_bytes
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype  # the element of an uncoded store (a coded one's scales: float32)
        self.coded = coded
        # [num_layers, num_blocks, num_kv_heads, head_dim], or coded (module docstring)
        self.sums: Tensor | CodedStore = (
            CodedStore("fp8", num_layers, num_blocks, num_kv_heads, head_dim, device) if coded
            else torch.zeros(num_layers, num_blocks, num_kv_heads, head_dim, dtype=dtype,
                             device=device))
        # [num_blocks] committed tokens summed into each block
        self.counts = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: a copy of the
        # committed keys, only for the exact-mass policies (topk_oracle, h2o).
        self.keys: Tensor | None = None
        if keep_keys:
            self.keys = torch.zeros(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                    dtype=key_dtype or dtype, device=device)
        # [num_layers, num_blocks, num_kv_heads, head_dim] per-channel min / max of the
        # committed keys (quest); an empty block holds +inf / -inf.
        self.mins: Tensor | None = None
        self.maxs: Tensor | None = None
        if keep_bounds:
            self.mins = torch.full((num_layers, num_blocks, num_kv_heads, head_dim),
                                   float("inf"), dtype=dtype, device=device)
            self.maxs = torch.full_like(self.mins, float("-inf"))
        # [num_layers, num_blocks, num_kv_heads, W] the sum over the block's committed keys
        # of (k - block mean)^2 (retrieval with variance=True): per channel (W = head_dim,
        # float32 whatever `dtype`) or, `compact_variance`, per band (W = `variance_width`,
        # in `variance_dtype`; module docstring), or coded per channel.
        self.variance_width = variance_width(head_dim, compact_variance)
        self.square_deviations: Tensor | CodedStore | None = None
        if keep_variance and coded:
            self.square_deviations = CodedStore("log8", num_layers, num_blocks, num_kv_heads,
                                                head_dim, device)
        elif keep_variance:
            self.square_deviations = torch.zeros(
                num_layers, num_blocks, num_kv_heads, self.variance_width,
                dtype=variance_dtype(dtype, compact_variance), device=device)
        # [num_layers, num_kv_heads, head_dim] float32, compact only: the per-channel M2
        # of every block folded so far (the channel profile, module docstring), and the
        # shares `variance_weights` reads, made again after a fold changed the profile.
        self.channel_profile: Tensor | None = None
        self._shares: Tensor | None = None
        if keep_variance and self.variance_width < head_dim:
            self.channel_profile = torch.zeros(num_layers, num_kv_heads, head_dim,
                                               dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.sums.device

    def add_committed(self, layer_keys: Sequence[Tensor], rows: Tensor, block_ids: Tensor,
                      offsets: Tensor, runs: tuple[Tensor, int] | None = None) -> None:
        """Add the committed tokens of one forward pass.

        layer_keys[l]: [num_tokens_in_pass, num_kv_heads * head_dim] or [T, H, D], the keys
        layer l wrote in the pass. rows [n] (long): which token rows are committed.
        block_ids [n], offsets [n]: each committed token's physical block and offset in it.
        A block that receives a token at offset 0 starts over first (a freed and reused
        block). Each token must be committed once; committing the same token twice counts it
        twice. `runs` = (run_of_token [n], num_runs): the tokens grouped by block, one run per
        block touched (numbered from 0), when the caller knows it on the host -- the engine
        does: a request's new tokens fill its own blocks in order. Without it the blocks are
        found with `unique`, which syncs a GPU.
        """
        if len(layer_keys) != self.num_layers:
            raise ValueError(f"expected keys of {self.num_layers} layers, got {len(layer_keys)}")
        if rows.numel() == 0:
            return
        rows, block_ids, offsets = (on_device(t, self.device, torch.long)
                                     for t in (rows, block_ids, offsets))
        if runs is None:
            touched, run_of_token = block_ids.unique(return_inverse=True)
            num_runs = touched.numel()
        else:
            run_of_token, num_runs = runs
            run_of_token = on_device(run_of_token, self.device, torch.long)
            touched = block_ids.new_zeros(num_runs).scatter_(0, run_of_token, block_ids)
        starts = torch.zeros(num_runs, dtype=torch.long, device=self.device).scatter_reduce_(
            0, run_of_token, (offsets == 0).long(), "amax")  # [S] 1: the block starts over
        self._reset_blocks(touched, starts.bool())
        keys = self._gather_rows(layer_keys, rows)  # [L, n, H, D]
        if self.coded:
            self._add_coded(keys, touched, run_of_token, starts.bool())
        elif self.square_deviations is not None:  # before sums and counts take the new keys
            self._add_deviations(keys, touched, run_of_token)
        if not self.coded:
            self.sums.index_add_(1, block_ids, keys.to(self.sums.dtype))
        self.counts.index_add_(0, block_ids, torch.ones_like(block_ids, dtype=torch.int32))
        if self.keys is not None:
            self.keys[:, block_ids, offsets] = keys.to(self.keys.dtype)
        if self.mins is not None:
            index = block_ids[None, :, None, None].expand_as(keys)  # [L, n, H, D]
            self.mins.scatter_reduce_(1, index, keys.to(self.mins.dtype), "amin")
            self.maxs.scatter_reduce_(1, index, keys.to(self.maxs.dtype), "amax")

    def set_blocks(self, block_ids: Tensor, keys: Tensor) -> None:
        """Replace every layer's summaries of the FULL blocks block_ids [n] (physical ids;
        a block listed twice, shared by two requests, gets the same values twice) by those
        of their keys [L, n, H, block_size, D] (any float dtype, e.g. read back from the KV
        cache: engine/paged_keys.py): what `add_committed` would hold after committing
        every offset of each block, whatever the blocks held before, so setting a block
        twice changes nothing (but a compact store's channel profile, a history of every
        fold). The engine's lazy summaries (engine/summary_keeper.py) use
        it, for all layers at once: a few operations per read, not a few per layer. Counts
        become block_size. `block_values` then `write_blocks`, the copied keys besides."""
        if keys.shape[3] != self.block_size:
            raise ValueError(f"set_blocks takes whole blocks of {self.block_size} keys, "
                             f"got {keys.shape[3]}")
        ids = on_device(block_ids, self.device, torch.long)
        keys = on_device(keys, self.device, torch.float32)  # [L, n, H, bs, D]
        self.write_blocks(ids, self.block_values(keys))
        if self.keys is not None:  # [L, num_blocks, bs, H, D]
            self.keys.index_copy_(1, ids, keys.transpose(2, 3).to(self.keys.dtype))

    def block_values(self, keys: Tensor) -> tuple[Tensor, ...]:
        """Whole blocks' keys [L, n, H, block_size, D] (float32) -> what `write_blocks`
        stores of them, as the stores hold it (a coded store's codes and scales), touching
        no store: the tensor work of `set_blocks`, which the engine may run compiled
        (engine/summary_keeper.py `BlockReads`). In order: the sums (coded: codes, scales);
        with the variance, the square deviations per channel (coded: codes, scales); with
        the bounds, the minima and maxima."""
        sums = keys.sum(3)  # [L, n, H, D]
        values = encode(sums, "fp8") if self.coded else (sums,)
        if self.square_deviations is not None:
            mean = sums / self.block_size
            per_channel = (keys - mean[:, :, :, None]).square_().sum(3)  # [L, n, H, D]
            values += encode(per_channel, "log8") if self.coded else (per_channel,)
        if self.mins is not None:
            values += (keys.amin(3), keys.amax(3))
        return values

    def write_blocks(self, ids: Tensor, values: Sequence[Tensor]) -> None:
        """Blocks ids [n] (int64, on the device) take `block_values`' values, their counts
        block_size."""
        values = list(values)
        self.counts.index_fill_(0, ids, self.block_size)
        if self.coded:
            self.sums.write_coded(ids, values.pop(0), values.pop(0))
        else:
            self.sums.index_copy_(1, ids, values.pop(0).to(self.sums.dtype))
        if self.square_deviations is not None:
            if self.coded:
                self.square_deviations.write_coded(ids, values.pop(0), values.pop(0))
            else:
                self.square_deviations.index_copy_(
                    1, ids, self._to_bands(values.pop(0)).to(self.square_deviations.dtype))
        if self.mins is not None:
            self.mins.index_copy_(1, ids, values.pop(0).to(self.mins.dtype))
            self.maxs.index_copy_(1, ids, values.pop(0).to(self.maxs.dtype))

    def _reset_blocks(self, block_ids: Tensor, starts: Tensor) -> None:
        """Empty blocks block_ids[i] where starts[i] (both [S]), without a data-dependent
        shape: every touched block is read and written back, emptied or not."""
        def reset(store: Tensor, empty: float, dim: int) -> None:
            index = (slice(None),) * dim + (block_ids,)
            keep = starts.view(-1, *([1] * (store.dim() - dim - 1)))
            store[index] = torch.where(keep, torch.full_like(store[index], empty), store[index])

        reset(self.counts, 0, 0)
        for store, empty in ((self.sums, 0.0), (self.keys, 0.0), (self.square_deviations, 0.0),
                             (self.mins, float("inf")), (self.maxs, float("-inf"))):
            if store is not None and not isinstance(store, CodedStore):  # coded: `_add_coded`
                reset(store, empty, 1)

    def _add_deviations(self, keys: Tensor, touched: Tensor, slot: Tensor) -> None:
        """Fold this pass's keys [L, n, H, D] into square_deviations of their blocks
        `touched` [T] (token i's block is touched[slot[i]]), by `_merged_m2`. Only the
        blocks this pass touched are read."""
        _, m2 = self._merged_m2(keys.float(), touched, slot, self.sums[:, touched].float())
        # compact: a band's M2 is the sum of its channels', so the update adds up the same way
        self.square_deviations[:, touched] += self._to_bands(m2).to(
            self.square_deviations.dtype)

    def _add_coded(self, keys: Tensor, touched: Tensor, slot: Tensor, starts: Tensor) -> None:
        """A coded store's fold: the blocks `touched` [T] (token i's block is
        touched[slot[i]]; starts [T]: the block starts over) read back in float32, this
        pass's keys [L, n, H, D] added (with the variance, by `_merged_m2`), coded again.
        Before the counts take the new keys; `_reset_blocks` emptied the counts of the
        blocks that start over."""
        keys = keys.float()
        kept = (~starts).float()[None, :, None, None]  # [1, T, 1, 1] 0: the block starts over
        sum_a = self.sums.gather(touched) * kept
        if self.square_deviations is None:
            sum_b = keys.new_zeros(sum_a.shape).index_add_(1, slot, keys)
        else:
            sum_b, m2 = self._merged_m2(keys, touched, slot, sum_a)
            m2_a = self.square_deviations.gather(touched) * kept
            self.square_deviations.write(touched, m2_a + m2)
        self.sums.write(touched, sum_a + sum_b)

    def _merged_m2(self, keys: Tensor, touched: Tensor, slot: Tensor,
                   sum_a: Tensor) -> tuple[Tensor, Tensor]:
        """Chan et al.'s merge of a pass's float32 keys [L, n, H, D] into blocks `touched`
        [T] (token i's block is touched[slot[i]]) that hold key sums sum_a [L, T, H, D] over
        `counts` tokens: with a block's old count, mean and M2 (n_a, mu_a, M2_a) and the new
        keys' (n_b, mu_b, M2_b), M2 = M2_a + M2_b + (mu_b - mu_a)^2 n_a n_b / (n_a + n_b).
        Returns (the new keys' sums per block, M2_b + the shift term: what M2_a gains)."""
        shape = (self.num_layers, touched.numel(), self.num_kv_heads, self.head_dim)
        n_b = torch.zeros(touched.numel(), device=keys.device).index_add_(
            0, slot, torch.ones_like(slot, dtype=torch.float32))[:, None, None]  # [T, 1, 1]
        sum_b = keys.new_zeros(shape).index_add_(1, slot, keys)
        mean_b = sum_b / n_b
        m2_b = keys.new_zeros(shape).index_add_(1, slot, (keys - mean_b[:, slot]).square_())
        n_a = self.counts[touched].float()[:, None, None]
        mean_a = sum_a / n_a.clamp(min=1)
        shift = (mean_b - mean_a).square() * (n_a * n_b / (n_a + n_b))
        return sum_b, m2_b + shift

    def _to_bands(self, per_channel: Tensor) -> Tensor:
        """[L, n, H, head_dim] square deviations -> the store's [L, n, H, variance_width],
        counted into the channel profile."""
        if self.channel_profile is not None:
            self.channel_profile += per_channel.sum(1)
            self._shares = None
        return fold_bands(per_channel, self.variance_width)

    def _gather_rows(self, layer_keys: Sequence[Tensor], rows: Tensor) -> Tensor:
        shape = (rows.numel(), self.num_kv_heads, self.head_dim)
        # [L, n, H, D]
        return torch.stack([on_device(k, self.device)[rows].reshape(shape) for k in layer_keys])

    def head_keys(self, layer: int, head: int, ids: Tensor) -> Tensor:
        """ids (any shape, physical block ids >= 0) -> [*ids.shape, D, block_size]: one
        layer's and KV head's copied keys (keep_keys=True), transposed (a view);
        engine/paged_keys.py reads the same from vLLM's own cache."""
        if self.keys is None:
            raise ValueError("block keys need BlockSummaries(keep_keys=True)")
        return self.keys[layer][:, :, head][ids].transpose(-1, -2)

    def deviations(self) -> Tensor:
        """square_deviations [L, num_blocks, H, W]; / counts = each channel's key variance
        (W = head_dim), or the sum of a band's channels' variances (compact)."""
        if self.square_deviations is None:
            raise ValueError("key variances need BlockSummaries(keep_variance=True)")
        return self.square_deviations

    def variance_weights(self, weights: Tensor) -> Tensor:
        """Per-channel weights [R, L, H, (G,) head_dim] of the key variance (a score's
        1/2 q^2) -> [R, L, H, (G,) W], so that weights . deviations() is sum_d w_d M2_d per
        channel, and compact, sum over bands of its M2 x its channels' weights, each by
        its share of the band in the channel profile (module docstring)."""
        shares = self.variance_shares()
        if shares is None:
            return fold_bands(weights, self.variance_width)
        shares = shares.view(self.num_layers, self.num_kv_heads,
                             *[1] * (weights.dim() - 4), self.head_dim)
        return fold_bands(weights * shares, self.variance_width)

    def variance_shares(self) -> Tensor | None:
        """[L, H, head_dim] float32 each channel's share of its band in the channel
        profile (made again after a fold changed it); None where the variance is kept per
        channel (no profile)."""
        if self.channel_profile is None:
            return None
        if self._shares is None:
            self._shares = band_shares(self.channel_profile, self.variance_width)
        return self._shares

    def with_compact_variance(self, dtype: torch.dtype | None = None, profile: bool = True,
                              bands: int = COMPACT_BANDS) -> "BlockSummaries":
        """These summaries with their per-channel variance folded into bands (`dtype`:
        its element, None: `variance_dtype`), sharing every other store: what summaries
        kept with `compact_variance=True` hold (up to the rounding of their own updates),
        for a benchmark that compares the two over one engine's keys (bench acceptance).
        `profile`: with the channel profile of every block in the store (False: bands
        weighed by their channels' mean weight); `bands`: COMPACT_BANDS or another."""
        if (self.square_deviations is None or self.variance_width != self.head_dim
                or self.coded):
            raise ValueError("with_compact_variance folds a float per-channel key variance")
        compact = BlockSummaries.__new__(BlockSummaries)
        vars(compact).update(vars(self))
        compact.variance_width = variance_width(self.head_dim, True, bands)
        compact.square_deviations = fold_bands(self.square_deviations, compact.variance_width).to(
            dtype or variance_dtype(self.dtype, True))
        per_channel = self.square_deviations.sum(1).float()  # [L, H, D]
        compact.channel_profile = per_channel if profile else torch.ones_like(per_channel)
        compact._shares = None
        return compact

    def layer_rows(self, blocks: Tensor) -> Tensor:
        """blocks [R, L, S] physical ids (-1 reads as block 0) -> [R, L, S] rows of a store
        viewed as [L * num_blocks, H * D]: compute once, read several stores (`rows_of`)."""
        ids = on_device(blocks, self.device, torch.long).clamp(min=0)
        layer = torch.arange(self.num_layers, device=self.device)[None, :, None]
        return layer * self.num_blocks + ids

    def rows_of(self, store: Tensor, rows: Tensor) -> Tensor:
        """store [L, num_blocks, H, W] at `layer_rows` [R, L, S] -> [R, L, S, H, W], one
        row gather (float32 from a coded store)."""
        picked = flat_rows(store, rows.flatten())
        return picked.view(*rows.shape, self.num_kv_heads, store.shape[-1])

    def bounds(self, layer: int, block_table: Tensor) -> tuple[Tensor, Tensor]:
        """One layer's key bounds: block_table [R, B] physical ids -> (mins, maxs), each
        [R, B, H, D] float32; an empty block's +-inf bounds read as 0."""
        if self.mins is None:
            raise ValueError("key bounds need BlockSummaries(keep_bounds=True)")
        ids = on_device(block_table, self.device, torch.long).clamp(min=0)
        return (self.mins[layer][ids].float().nan_to_num(0.0, 0.0, 0.0),
                self.maxs[layer][ids].float().nan_to_num(0.0, 0.0, 0.0))

    def nbytes(self) -> int:
        total = self.sums.nbytes + self.counts.nbytes
        if self.keys is not None:
            total += self.keys.nbytes
        if self.mins is not None:
            total += self.mins.nbytes + self.maxs.nbytes
        if self.square_deviations is not None:
            total += self.square_deviations.nbytes
        if self.channel_profile is not None:
            total += self.channel_profile.nbytes
        return total

