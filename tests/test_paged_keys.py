"""engine/paged_keys.py: `rerank` reads keys from vLLM's KV cache in each backend's layout.

CPU_ATTN's layout is whatever its C++ writer does, so these tests write with that writer
(`cpu_attn_reshape_and_cache`, the op CPU_ATTN's forward calls) and read back. The logical
layout (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER) is exercised end to end on
FLEX in tests/test_flex_backend.py."""

import types

import pytest
import torch

from vllm_triforce.engine.paged_keys import PagedKeys, paged_keys_for

B, H, BS, T = 4, 2, 32, 70  # 70 tokens written from slot 32 on: blocks 1, 2 and 3


def layers_of(kv_cache, head_dim, num_layers=1, **extra):
    return [types.SimpleNamespace(kv_cache=kv_cache, num_kv_heads=H, head_size=head_dim,
                                  **extra) for _ in range(num_layers)]


def cpu_written(isa, dtype, head_dim):
    """(kv_cache [B, H, BS, 2D] as CPU_ATTN's writer left it, keys [T, H, D], slots [T])."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    kv_cache = torch.zeros(B, H, BS, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(B, H, 2 * BS, head_dim).chunk(2, dim=2)
    keys = torch.randn(T, H, head_dim).to(dtype)
    slots = torch.arange(T) + BS
    ops.cpu_attn_reshape_and_cache(keys, torch.randn_like(keys), key_cache, value_cache, slots,
                                   isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv_cache, keys, slots


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_attn_keys_read_back_exactly(isa, dtype, head_dim):
    kv_cache, keys, slots = cpu_written(isa, dtype, head_dim)
    layer = layers_of(kv_cache, head_dim, isa=isa)
    reader, why = paged_keys_for(layer, "CPU_ATTN", BS, "auto")
    assert why == "" and reader.layout == "cpu_transposed"
    read = reader.block_keys(0, torch.tensor([[1, 2], [3, 0]]))  # any index shape
    assert read.shape == (2, 2, BS, H, head_dim)
    flat = read.reshape(4 * BS, H, head_dim)  # blocks 1, 2, 3, 0 in slot order
    assert torch.equal(flat[:T], keys) and not flat[3 * BS:].any()
    # the lazy summaries' read: every head's keys of the blocks, [*, H, BS, D], K alone
    assert torch.equal(reader.layer_keys(0, torch.tensor([[1, 2], [3, 0]])), read.transpose(2, 3))
    block_ids, offsets = slots // BS, slots % BS
    assert reader.check([keys.flatten(1)], torch.arange(T), block_ids, offsets) == ""


def test_check_catches_a_wrong_layout():
    """The runtime check is what stands between a misread layout and silently useless
    selections: reading CPU_ATTN's cache as the logical layout must fail it."""
    kv_cache, keys, slots = cpu_written("vec", torch.float32, 64)
    wrong = PagedKeys(layers_of(kv_cache, 64), "logical", BS)
    why = wrong.check([keys], torch.arange(T), slots // BS, slots % BS)
    assert "layer 0" in why and "logical" in why
    kernel_view = PagedKeys(layers_of(kv_cache.view(2 * B, H, BS // 2, 128), 64), "logical", BS)
    assert "kernel-block" in kernel_view.check([keys], torch.arange(T), slots // BS, slots % BS)


def test_logical_fp8_keys_are_dequantised():
    """fp8 caches hold key / k_scale (vLLM's per-tensor scale); the reader multiplies back."""
    torch.manual_seed(0)
    scale, head_dim = 0.5, 64
    keys = torch.randn(T, H, head_dim)
    kv_cache = torch.zeros(B, H, BS, 2 * head_dim, dtype=torch.uint8)
    slots = torch.arange(T) + BS
    quantised = (keys / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    kv_cache[slots // BS, :, slots % BS, :head_dim] = quantised
    layer = layers_of(kv_cache, head_dim, _k_scale_float=scale)
    reader, why = paged_keys_for(layer, "FLASH_ATTN", BS, "fp8")
    assert why == ""
    read = reader.block_keys(0, torch.tensor([1, 2, 3])).reshape(3 * BS, H, head_dim)[:T]
    assert torch.equal(read, quantised.view(torch.float8_e4m3fn).float() * scale)
    assert reader.check([keys], torch.arange(T), slots // BS, slots % BS) == ""
    assert reader.check([keys * 1.5], torch.arange(T), slots // BS, slots % BS) != ""


@pytest.mark.parametrize("backend,isa,dtype,named", [
    ("CPU_ATTN", "amx", "auto", "'amx'"),
    ("CPU_ATTN", "vec", "fp8", "fp8"),
    ("TREE_ATTN", None, "auto", "TREE_ATTN"),
    ("FLASHINFER", None, "nvfp4", "nvfp4"),
    ("TRITON_ATTN", None, "int8_per_token_head", "int8_per_token_head"),
])
def test_unknown_layouts_are_not_read(backend, isa, dtype, named):
    reader, why = paged_keys_for(layers_of(torch.zeros(1), 64, isa=isa), backend, BS, dtype)
    assert reader is None and named in why


@pytest.mark.parametrize("case", ["cpu_transposed-coded", "logical-float-bounds",
                                  "logical-fp8-compact", "logical-coded-refused"])
def test_compiled_block_reads_set_what_the_eager_reads_set(case, monkeypatch):
    """`compiled_selection`'s read of lazy summaries (summary_keeper.BlockReads): one
    compiled function over every layer's cache sets the summaries the eager reads (a read
    per layer, then set_blocks' arithmetic) set, for read chunks of 1 to 5 blocks, with no
    compilation after the first, compiled only once the layers hold a cache; the eager path
    is `set_blocks` itself. Three layers, each cache its own tensor, as vLLM allocates
    them. `refused`: the compilation with the chunk's size unbacked fails (as inductor's
    did on an H200 with torch 2.11), so the size is compiled dynamic, from 2 blocks on, and
    a chunk of one block is read as two."""
    from torch._dynamo.utils import counters

    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.core.summary_coding import CodedStore
    from vllm_triforce.engine import summary_keeper
    from vllm_triforce.engine.summary_keeper import BlockReads

    layout, kind, *extra = case.split("-")
    refused = extra == ["refused"]
    if refused:
        def unbacked(*args):
            raise RuntimeError("GuardOnDataDependentSymNode: Could not guard on Eq(1, u0)\n"
                               "consider using data-dependent friendly APIs")
        monkeypatch.setattr(summary_keeper, "mark_unbacked", unbacked)
    num_layers, head_dim, num_blocks = 3, 16, 6
    gen = torch.Generator().manual_seed(1)
    fp8 = kind == "fp8"

    def cache():
        values = torch.randn(num_blocks, H, BS, 2 * head_dim, generator=gen)
        return values.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else values

    # before vLLM allocates its cache, each layer holds an empty placeholder
    layers = [types.SimpleNamespace(kv_cache=torch.tensor([]), num_kv_heads=H,
                                    head_size=head_dim, _k_scale_float=0.5 + layer)
              for layer in range(num_layers)]
    reader = PagedKeys(layers, layout, BS, "fp8" if fp8 else "auto")

    def summaries():
        return BlockSummaries(num_layers, num_blocks, H, head_dim, BS, keep_variance=True,
                              coded=kind == "coded", keep_bounds=extra == ["bounds"],
                              compact_variance=extra == ["compact"])

    eager, compiled = summaries(), summaries()
    reads = BlockReads(compiled)
    reads.wanted = True
    reads.compile_when_bound(reader, "in the test")
    assert reads.compiled is None  # nothing to compile over yet
    for layer in layers:
        layer.kv_cache = cache()
    reads.compile_when_bound(reader, "in the test")
    assert reads.compiled is not None and reads.compile_seconds > 0
    assert reads.padded == refused
    graphs = counters["stats"]["unique_graphs"]
    for ids in ([4], [0, 5, 2], [1, 3, 2, 0, 5]):
        ids = torch.tensor(ids)
        keys = torch.stack([reader.layer_keys(layer, ids) for layer in range(num_layers)])
        eager.set_blocks(ids, keys.float())
        compiled.write_blocks(ids, reads(reader, ids))
        assert reads.compiled is not None, "the compiled read fell back to eager"
    assert counters["stats"]["unique_graphs"] == graphs  # no chunk size compiled anew
    stores = ["counts", "sums", "square_deviations", "mins", "maxs", "channel_profile"]
    for name in stores:
        want, got = getattr(eager, name), getattr(compiled, name)
        if want is None:
            assert got is None
        elif isinstance(want, CodedStore):  # one rounding each: codes may differ by one
            assert (want.codes.int() - got.codes.int()).abs().max() <= 1, name
            torch.testing.assert_close(got.scales, want.scales, rtol=1e-5, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    assert compiled.counts.tolist() == [BS] * num_blocks
