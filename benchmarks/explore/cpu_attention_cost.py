"""What vLLM's CPU attention costs per query token: why verifying k drafts is dear on a CPU.

Calls vLLM's own CPU_ATTN kernel (`vllm._custom_ops.cpu_attention_with_kv_cache`, the op a
decode step and a verification step both run) on a random paged KV cache of the README
demo's shape: SmolLM2-135M's attention (9 query heads, 3 KV heads of 64), `--batch`
requests of `--context` tokens, 32-token blocks, float32, and prints the milliseconds of
all `--layers` layers for 1, 2, 4 and 7 query tokens per request (a decode step is 1; a
verification of k drafts is k + 1). On a GPU, FlashAttention verifies k tokens for about
one step's price; where this kernel's cost grows with the query tokens, a verification
costs several decode steps and TriForce's drafts must pay for that.

    .venv/bin/python benchmarks/explore/cpu_attention_cost.py [--batch 4] [--context 7936]
"""

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=7936)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, kv_heads, head_dim, block = 9, 3, 64, 32
    dtype = torch.float32
    isa = _get_attn_isa(dtype, block, head_dim)
    blocks_per_request = -(-args.context // block)
    kv = torch.randn(args.batch * blocks_per_request, kv_heads, 2 * block, head_dim, dtype=dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    table = torch.arange(kv.shape[0], dtype=torch.int32).view(args.batch, -1)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    print(f"vLLM CPU_ATTN ({isa}), float32, {args.batch} x {args.context} tokens, "
          f"{args.layers} layers, {torch.get_num_threads()} threads")
    one = None
    for q in (1, 2, 4, 7):
        starts = torch.arange(0, args.batch * q + 1, q, dtype=torch.int32)
        query = torch.randn(args.batch * q, heads, head_dim, dtype=dtype)
        out = torch.empty_like(query)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=args.batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=starts, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)

        def layer() -> None:
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=starts, seq_lens=seq_lens, scale=head_dim ** -0.5,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=meta, s_aux=None)

        layer()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.repeats):
                layer()
            best = min(best, (time.perf_counter() - start) / args.repeats)
        ms = 1000 * best * args.layers
        one = one or ms
        print(f"  {q} query token{'s' if q > 1 else ' '} per request: {ms:7.1f} ms "
              f"({ms / one:.2f}x a decode step's attention)")


if __name__ == "__main__":
    main()
