"""Read the target's committed keys straight from vLLM's paged KV cache (no key copy).

`rerank` (core/key_policies.py) scores a shortlist of blocks by their exact attention mass, so
it needs the keys of those blocks. The KV cache already holds them; what differs per
backend is the layout, and a wrong guess would not break outputs (the full cache verifies
every token) but would quietly rank blocks by garbage. So the reader knows a layout only
where it was established, and checks it against the keys the capture hook saw being written
before it is trusted (`check`, once, at the first commit).

Each attention layer's `kv_cache` (bound by vLLM's `bind_kv_cache`, 0.32.0) is the logical
view [num_blocks, num_kv_heads, block_size, 2 * head_size], K in the first head_size
channels (vllm/v1/kv_cache_interface.py `create_kv_cache_views`). Layouts:
- `logical`: FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER index that view as it is
  (each `forward` splits it with `.split(head_size, dim=-1)`), whatever stride order the
  engine's KV-cache layout gives it. fp8 caches (`fp8`, `fp8_e4m3`, `fp8_e5m2`) hold the
  keys divided by the layer's `_k_scale_float`.
- `cpu_transposed`: CPU_ATTN re-views each (block, head) page as [2 * block_size,
  head_size] and its C++ writer packs K per ISA (cpu_attn.py `forward`). For the `vec` and
  `vec16` ISAs K is [head_size, block_size] per (block, head), as
  `cpu_attn_reshape_and_cache` writes it (tests/test_paged_keys.py checks it). `amx` packs
  tiles differently, and other ISAs are unknown: not read.
Anything else (per-token-head quantised caches, NVFP4, TurboQuant, another ISA, kernel
blocks smaller than the scheduler's) is `unreadable`: the reason is logged and `rerank`
keeps its first stage only.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOGICAL_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
CPU_TRANSPOSED_ISAS = ("vec", "vec16")
PLAIN_DTYPES = ("auto", "float16", "bfloat16", "float32")
CHECKED_TOKENS = 64  # `check` compares the first this many committed tokens of each layer
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


class PagedKeys:
    """Keys of physical blocks, read from each target layer's `layer.kv_cache`.

    layers: the target's attention layers in layer order (`kv_cache`, `num_kv_heads`,
    `head_size`, and for fp8 `_k_scale_float`); layout: `logical` or `cpu_transposed`.
    Quacks like BlockSummaries for RerankPolicy.exact_scores: `head_keys`, `num_kv_heads`,
    `block_size`, `device`.
    """

    def __init__(self, layers, layout: str, block_size: int, kv_cache_dtype: str = "auto"):
        if layout not in ("logical", "cpu_transposed"):
            raise ValueError(f"unknown paged-key layout {layout!r}")
        self.layers = list(layers)
        self.layout = layout
        self.block_size = block_size
        self.num_kv_heads = self.layers[0].num_kv_heads
        self.head_dim = self.layers[0].head_size
        self.fp8 = FP8_DTYPES.get(kv_cache_dtype)
        self.checked = False

    @property
    def device(self) -> torch.device:
        return self.layers[0].kv_cache.device

    def head_keys(self, layer: int, head: int, ids: Tensor) -> Tensor:
        """ids (any shape, physical block ids >= 0) -> [*ids.shape, D, block_size]: one KV
        head's keys (what RerankPolicy.exact_scores multiplies by; fp8: dequantised). Only
        that head's pages are gathered: no copy of the others, no transpose on CPU_ATTN."""
        kv = self.layers[layer].kv_cache
        num_blocks, heads, bs, _ = kv.shape
        d = self.head_dim
        if self.layout == "logical":
            keys = kv[:, head, :, :d][ids].transpose(-1, -2)  # [*, bs, D] -> [*, D, bs]
        else:
            keys = kv.view(num_blocks, heads, 2 * bs * d)[:, head, :bs * d][ids].unflatten(
                -1, (d, bs))
        if self.fp8 is not None:
            keys = keys.view(self.fp8).float() * self.layers[layer]._k_scale_float
        return keys

    def layer_keys(self, layer: int, ids: Tensor) -> Tensor:
        """ids (any shape, physical block ids >= 0) -> [*ids.shape, H, block_size, D]: every
        head's keys of those blocks (fp8: dequantised), one gather per layer (the lazy block
        summaries' eager read: engine/summary_keeper.py `BlockReads`)."""
        return self.keys_of(self.layers[layer].kv_cache, ids, self.key_scale(layer))

    def caches(self) -> list[Tensor]:
        """Each layer's KV cache, in layer order (`every_layer_keys` reads them)."""
        return [layer.kv_cache for layer in self.layers]

    def bound(self) -> bool:
        """Whether every layer holds vLLM's KV cache (before vLLM allocates it, a layer
        holds an empty placeholder)."""
        return all(layer.kv_cache.numel() for layer in self.layers)

    def key_scale(self, layer: int) -> float | None:
        """An fp8 cache's key scale of `layer` (None: a plain cache)."""
        return None if self.fp8 is None else float(self.layers[layer]._k_scale_float)

    def keys_of(self, kv: Tensor, ids: Tensor, scale: float | None) -> Tensor:
        """`layer_keys` of the layer whose cache is `kv` (key scale `scale`)."""
        num_blocks, heads, bs, _ = kv.shape
        d = self.head_dim
        if self.layout == "logical":
            keys = kv[..., :d][ids]  # [*, H, bs, D]: gathers K only
        else:  # per (block, head): K as [D, bs], then V; the view's K half is gathered alone
            keys = kv.view(num_blocks, heads, 2, bs * d)[:, :, 0][ids].unflatten(
                -1, (d, bs)).transpose(-1, -2)
        if self.fp8 is not None:
            keys = keys.view(self.fp8).float() * scale
        return keys

    def every_layer_keys(self, ids: Tensor, caches: list[Tensor],
                         scales: list[float | None]) -> Tensor:
        """ids [n] -> [L, n, H, block_size, D] float32: every layer's keys of those blocks,
        from `caches()` (key scales `scales`), as one expression (compiled, one call:
        engine/summary_keeper.py `BlockReads`)."""
        return torch.stack([self.keys_of(kv, ids, scale).float()
                            for kv, scale in zip(caches, scales)])

    def block_keys(self, layer: int, ids: Tensor) -> Tensor:
        """ids (any shape) -> [*ids.shape, block_size, H, D]: every head's keys (check)."""
        return self.layer_keys(layer, ids).transpose(-3, -2)

    def check(self, layer_keys, rows: Tensor, block_ids: Tensor, offsets: Tensor) -> str:
        """'' when the cache's keys at (block_ids, offsets) equal the keys the capture hook
        saw written there (layer_keys[l][rows]), else what differs. Exact for plain caches;
        fp8 within its rounding (relative 2^-4 for e4m3, 2^-3 for e5m2, plus subnormals).
        Only the first CHECKED_TOKENS tokens are compared: enough to tell a layout."""
        self.checked = True
        rows, block_ids, offsets = (t[:CHECKED_TOKENS] for t in (rows, block_ids, offsets))
        for index, captured in enumerate(layer_keys):
            kv = self.layers[index].kv_cache
            if kv.dim() != 4 or kv.shape[2] != self.block_size:
                return (f"layer {index}'s cache has shape {tuple(kv.shape)}, not blocks of "
                        f"{self.block_size} tokens (a kernel-block view?)")
            ids = block_ids.to(kv.device, torch.long)
            read = self.block_keys(index, ids)  # [n, bs, H, D]
            read = read[torch.arange(ids.numel(), device=kv.device), offsets.to(kv.device)]
            want = captured.to(kv.device)[rows.to(kv.device)].reshape(read.shape)
            if self.fp8 is None:
                same = torch.equal(read, want.to(read.dtype))
            else:
                tol = 2.0 ** (-4 if self.fp8 == torch.float8_e4m3fn else -3)
                scale = float(self.layers[index]._k_scale_float)
                err = (read - want.float()).abs()
                same = not bool((err > tol * want.float().abs() + 2.0 ** -9 * scale).any())
            if not same:
                return f"layer {index}'s keys read from the {self.layout} layout differ"
        return ""


def paged_keys_for(layers, backend: str, block_size: int,
                   kv_cache_dtype: str) -> tuple[PagedKeys | None, str]:
    """(a reader, "") when the layout of `backend` is one PagedKeys knows, else (None, why)."""
    kv_cache_dtype = str(kv_cache_dtype)
    if backend == "CPU_ATTN":
        isa = getattr(layers[0], "isa", None)
        if isa not in CPU_TRANSPOSED_ISAS:
            return None, (f"CPU_ATTN's {isa!r} ISA packs keys in a layout vllm-triforce does "
                          f"not read (it reads {', '.join(CPU_TRANSPOSED_ISAS)})")
        if kv_cache_dtype not in PLAIN_DTYPES:
            return None, f"CPU_ATTN with kv_cache_dtype {kv_cache_dtype!r}"
        return PagedKeys(layers, "cpu_transposed", block_size), ""
    if backend not in LOGICAL_BACKENDS:
        return None, f"attention backend {backend} (read: CPU_ATTN, {', '.join(LOGICAL_BACKENDS)})"
    if kv_cache_dtype not in PLAIN_DTYPES and kv_cache_dtype not in FP8_DTYPES:
        return None, f"kv_cache_dtype {kv_cache_dtype!r} (read: plain and per-tensor fp8)"
    return PagedKeys(layers, "logical", block_size, kv_cache_dtype), ""
