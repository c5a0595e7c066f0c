"""Block summaries in one byte per value: the store `compact_summaries` keeps (config.py).

A summary store is [L, N, H, D] (layer, physical block, KV head, channel). Coded, each value
takes one byte and each row of D values (one layer's, block's and KV head's) one float32
scale, so a block's summaries cost a third of bf16 sums and float32 variances (2 bytes a
channel, not 6):
- "fp8": a signed value (the key sums) in float8 e4m3, scaled so the row's largest
  magnitude is e4m3's largest (448): 3 mantissa bits, within 6.25% of every value down to
  2^-14.8 of the row's largest (e4m3's normals), within 2^-18.8 of it below;
- "log8": a value >= 0 (the keys' square deviations) as c = round(LOG8_STEPS x
  log2(row max / value)), read back as row max x 2^(-c / LOG8_STEPS): within 2.2% of every
  value down to 2^-15.9 of the row's largest; code 255 (or below that) reads as 0.
Why these two: the variance keeps a value per channel (a needle's channels are its own; 8
bands of them lose what a per-channel variance finds) at the bytes the bands took. The
acceptance bench's column `retrieval_var_fp8_log` is this coding (benchmarks/RESULTS.md
against the float summaries; benchmarks/HISTORY.md for the codings it was chosen from).

Example, one row of the log code: [8.0, 2.0, 0.0, 1.0] -> top 8.0, codes [0, 32, 255, 48],
read back [8.0, 2.0, 0.0, 1.0]; 3.0 would be code round(16 log2(8/3)) = 23 and read back
8 x 2^(-23/16) = 2.95.

A `CodedStore` is written whole blocks at a time (`write`) and read by the policies as
float32 through the same reads a tensor store takes (core/reads.py): a gather of blocks, a
slice of the block axis, rows of the [L x N] flattening.
"""

from __future__ import annotations

import torch
from torch import Tensor

CODINGS = ("fp8", "log8")
FP8 = torch.float8_e4m3fn
LOG8_STEPS = 16  # codes per octave below the row's largest value
LOG8_ZERO = 255  # the code read back as 0
_TINY = 1e-30
SCALE_BYTES = 4  # a row's float32 scale


def encode(x: Tensor, coding: str) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes [..., D] uint8, scales [..., 1] float32), per row of D (an fp8
    code is the float8 e4m3 value's byte: torch copies no float8 by index on a CPU)."""
    x = x.float()
    if coding == "fp8":
        scale = x.abs().amax(-1, keepdim=True).clamp(min=_TINY) / torch.finfo(FP8).max
        return (x / scale).to(FP8).view(torch.uint8), scale
    if coding == "log8":
        top = x.amax(-1, keepdim=True).clamp(min=0.0)  # a row of zeros reads back 0
        code = (LOG8_STEPS * torch.log2(top.clamp(min=_TINY) / x.clamp(min=_TINY))).round_()
        return code.clamp_(max=LOG8_ZERO).to(torch.uint8), top
    raise ValueError(f"coding must be one of {CODINGS}, not {coding!r}")


def decode(codes: Tensor, scales: Tensor, coding: str) -> Tensor:
    """`encode`'s (codes [..., D], scales [..., 1]) -> [..., D] float32, made in place: no
    copy larger than the float32 result (a chunked read's bound, core/reads.py)."""
    if coding == "fp8":
        return codes.view(FP8).float().mul_(scales)
    values = codes.float().mul_(-1.0 / LOG8_STEPS).exp2_().mul_(scales)
    return values.masked_fill_(codes == LOG8_ZERO, 0.0)


def decode_table(coding: str, device=None) -> Tensor:
    """[256] float32: what each code reads back as at scale 1, so that `decode(codes,
    scales)` is `decode_table(coding)[codes] * scales`, value for value (the same
    operations, on every code at once; fp8's two NaN codes, which `encode` never makes,
    read 0). A compiled read decodes with it inside its kernel (core/fused_reads.py)."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return decode(codes, torch.ones((), device=device), coding).nan_to_num_(0.0)


def rounded(x: Tensor, coding: str) -> Tensor:
    """x [..., D] as a coded store holds it: decode(encode(x)) (the bench's columns)."""
    return decode(*encode(x, coding), coding)


class CodedStore:
    """A summary store [L, N, H, D] coded per row (module docstring): `codes` [L, N, H, D]
    uint8 and `scales` [L, N, H, 1] float32. Reads decode to float32."""

    def __init__(self, coding: str, num_layers: int, num_blocks: int, num_kv_heads: int,
                 width: int, device=None):
        if coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, not {coding!r}")
        self.coding = coding
        # an empty store reads as 0: fp8 0.0, or the log code's zero
        self.codes = torch.full((num_layers, num_blocks, num_kv_heads, width),
                                0 if coding == "fp8" else LOG8_ZERO, dtype=torch.uint8,
                                device=device)
        self.scales = torch.zeros(num_layers, num_blocks, num_kv_heads, 1,
                                  dtype=torch.float32, device=device)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def dtype(self) -> torch.dtype:
        """uint8, the codes' (never float32: a coded store is read in chunks)."""
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def write(self, ids: Tensor, values: Tensor) -> None:
        """Blocks ids [n] (a block listed twice: the last one's values) take values
        [L, n, H, D] (any float dtype), coded."""
        self.write_coded(ids, *encode(values, self.coding))

    def write_coded(self, ids: Tensor, codes: Tensor, scales: Tensor) -> None:
        """Blocks ids [n] take `encode`'s codes [L, n, H, D] and scales [L, n, H, 1]."""
        self.codes.index_copy_(1, ids, codes)
        self.scales.index_copy_(1, ids, scales)

    def gather(self, ids: Tensor) -> Tensor:
        """Blocks ids [n] -> [L, n, H, D] float32."""
        return decode(self.codes.index_select(1, ids), self.scales.index_select(1, ids),
                      self.coding)

    def blocks(self, chunk: slice) -> Tensor:
        """A slice of the block axis -> [L, s, H, D] float32."""
        return decode(self.codes[:, chunk], self.scales[:, chunk], self.coding)

    def rows(self, rows: Tensor) -> Tensor:
        """rows [n] of the store viewed as [L * N, H, D] -> [n, H, D] float32."""
        num_layers, num_blocks = self.codes.shape[:2]
        flat = num_layers * num_blocks
        return decode(self.codes.view(flat, *self.codes.shape[2:]).index_select(0, rows),
                      self.scales.view(flat, *self.scales.shape[2:]).index_select(0, rows),
                      self.coding)

    def fill_(self, values: Tensor) -> "CodedStore":
        """Every block takes values [L, N, H, D] (benchmarks' synthetic summaries)."""
        self.write(torch.arange(self.codes.shape[1], device=self.device), values)
        return self
