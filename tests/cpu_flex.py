"""TEST patch: let vLLM's CPU platform run FLEX_ATTENTION, gated on `VLLM_TRIFORCE_CPU_FLEX=1`.

Why: TriForce's middle level builds attention metadata per layer (`engine/device/forward.py`).
Metadata builders that keep state between `build()` calls (FLEX_ATTENTION's persistent
`physical_to_logical` / `kv_indices` buffers, FlashInfer's shared wrapper) would make every
layer attend over the last layer's table. CPU_ATTN's builder is stateless, so on this CPU no
test could see that; with this patch `tests/test_flex_backend.py` runs a stateful builder
for real. It is a test aid, not a feature: it lives in tests/, so the plugin neither ships nor
applies it; those tests call `apply()`, and without the env variable even that records the
patch as not applicable and changes nothing. It uses the plugin's patch helpers
(`vllm_triforce.patches._util`), so it checks and wraps as every patch does.

What it replaces (vLLM 0.32.0), only when the patch is active:
- `platforms/cpu.py::CpuPlatform.get_attn_backend_cls` (wrapped): returns CPU_ATTN for every
  request (~177); the wrapper returns FLEX_ATTENTION when the user asked for it
  (`attention_config={"backend": "FLEX_ATTENTION"}` / `--attention-backend`), else defers.
- `v1/attention/backends/flex_attention.py::FlexAttentionImpl.do_kv_cache_update`
  (replaced): calls `torch.ops._C_cache_ops.reshape_and_cache_flash`, which the CPU build
  lacks; ours writes K/V by slot with plain torch indexing.
- `flex_attention.py::flex_attention_compiled` and `create_block_mask_compiled` (replaced):
  module-level `torch.compile` wrappers. Compiling would bring inductor and its C++
  toolchain into tests that run `enforce_eager=True`. torch's uncompiled
  flex_attention runs but is ~4x slower than CPU_ATTN here (it traces the mask with dynamo
  on every call and evaluates it per head through vmap). `flex_attention_eager` computes
  what the compiled kernel does, in plain torch: the metadata's `mask_mod` (which reads
  the builder's persistent `physical_to_logical`) evaluated once by broadcasting, ANDed
  with the KV blocks the block mask lists (its persistent `kv_indices`), then SDPA. Exact,
  but dense over the whole KV cache: engines using it want a small cache
  (`num_gpu_blocks_override`).

Why a patch: the CPU platform has no option to select another backend, and the FLEX impl
has no hook for its cache write or its kernel. Remove when vLLM's CPU platform accepts
FLEX_ATTENTION and its impl writes the cache through a platform op (or when TriForce's
per-layer metadata is tested on a GPU runner).
"""

import os

import torch

from vllm_triforce.patches import _util

NAME = "cpu_flex"
ENV = "VLLM_TRIFORCE_CPU_FLEX"
PLATFORM_MODULE = "vllm.platforms.cpu"
FLEX_MODULE = "vllm.v1.attention.backends.flex_attention"


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def _make_get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        flex = AttentionBackendEnum.FLEX_ATTENTION
        plain_attention = not (attn_selector_config.use_mla or attn_selector_config.use_sparse)
        if selected_backend == flex and plain_attention:
            return flex.get_path()
        return original(selected_backend, attn_selector_config, *args, **kwargs)

    return get_attn_backend_cls


def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
    """Write this step's K/V into the paged cache at `slot_mapping` (slot = block * block_size
    + offset; negative slots are padding and skipped, as in `reshape_and_cache_flash`).

    key, value: [num_tokens (>= num_slots), num_kv_heads, head_size]
    kv_cache:   [num_blocks, num_kv_heads, block_size, 2 * head_size] (a view of the LBNHC
                layout: block, token, head, K|V channels)
    """
    from vllm.v1.attention.backend import AttentionType

    if self.attn_type == AttentionType.ENCODER_ONLY:
        return
    num_slots = slot_mapping.shape[0]
    by_token = kv_cache.transpose(1, 2)  # [num_blocks, block_size, num_kv_heads, 2 * head_size]
    # .view (not flatten/reshape): raises instead of silently writing into a copy.
    flat = by_token.view(-1, *by_token.shape[2:])  # [num_blocks * block_size, heads, 2 * hs]
    valid = slot_mapping >= 0  # [num_slots]
    kv = torch.cat([key[:num_slots], value[:num_slots]], dim=-1)  # [num_slots, heads, 2 * hs]
    flat[slot_mapping[valid].long()] = kv[valid].to(flat.dtype)


def flex_attention_eager(query, key, value, score_mod=None, block_mask=None, scale=None,
                         enable_gqa=False, kernel_options=None, return_aux=None):
    """What FLEX's compiled kernel computes, in eager torch: each query attends to the cache
    tokens of the KV blocks its q-block's `kv_indices` lists AND its `mask_mod` allows
    (`full_kv_indices` is None in vLLM's direct build, so every listed block is masked).

    query [1, num_heads, num_tokens, head_size]; key, value [1, num_kv_heads, cache_tokens,
    head_size] (the whole paged cache, flattened). Anything else vLLM may pass (a
    score_mod, auxiliary outputs) goes to torch's reference flex_attention.
    """
    if score_mod is not None or return_aux is not None:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(query, key, value, score_mod, block_mask, scale,
                              enable_gqa=enable_gqa, kernel_options=kernel_options,
                              return_aux=return_aux)
    num_tokens, cache_tokens = query.shape[2], key.shape[2]
    q_idx = torch.arange(num_tokens, device=query.device)[:, None]  # [num_tokens, 1]
    kv_idx = torch.arange(cache_tokens, device=query.device)[None, :]  # [1, cache_tokens]
    zero = torch.zeros((), dtype=torch.long, device=query.device)
    allowed = block_mask.mask_mod(zero, zero, q_idx, kv_idx)  # [num_tokens, cache_tokens]
    allowed = allowed & _listed_blocks(block_mask, num_tokens, cache_tokens)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)


def _listed_blocks(block_mask, num_tokens: int, cache_tokens: int) -> torch.Tensor:
    """[num_tokens, cache_tokens] bool: the cache blocks listed for each query's q-block.

    Example, BLOCK_SIZE (16, 32), kv_num_blocks [2], kv_indices [[3, 1, -1]]: tokens 0-15
    see cache tokens 32-63 and 96-127."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    num_listed = block_mask.kv_num_blocks[0, 0]  # [num_q_blocks]
    indices = block_mask.kv_indices[0, 0].long()  # [num_q_blocks, max_listed]
    listed = torch.arange(indices.shape[1], device=indices.device) < num_listed[:, None]
    rows = torch.arange(indices.shape[0], device=indices.device)[:, None].expand_as(indices)
    blocks = torch.zeros(indices.shape[0], cache_tokens // kv_block, dtype=torch.bool,
                         device=indices.device)  # [num_q_blocks, num_cache_blocks]
    blocks[rows[listed], indices[listed]] = True
    per_token = blocks.repeat_interleave(q_block, dim=0)[:num_tokens]
    return per_token.repeat_interleave(kv_block, dim=1)  # [num_tokens, cache_tokens]


def _create_block_mask_eager(*args, **kwargs):
    """torch's create_block_mask, uncompiled (vLLM calls it only off its direct build)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(*args, **kwargs)


def apply() -> None:
    if not enabled():
        _util.APPLIED.setdefault(NAME, False)  # stays True once an earlier apply() patched
        return
    _util.wrap(PLATFORM_MODULE, "CpuPlatform.get_attn_backend_cls",
               _make_get_attn_backend_cls, NAME)
    _util.replace(FLEX_MODULE, "FlexAttentionImpl.do_kv_cache_update", do_kv_cache_update, NAME)
    _util.replace(FLEX_MODULE, "flex_attention_compiled", _delegate(flex_attention_eager), NAME)
    _util.replace(FLEX_MODULE, "create_block_mask_compiled", _delegate(_create_block_mask_eager),
                  NAME)


def _delegate(fn):
    """A new function calling `fn`. `_util.replace` copies the replaced torch.compile
    wrapper's attributes (name, doc, `_torchdynamo_*`) onto what it installs; they land on
    this delegate and `fn` keeps its own."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call
