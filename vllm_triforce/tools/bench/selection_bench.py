"""Micro-benchmark: cost of one block selection (score + select + build tables).

A 32K-token request, block size 32, 30 layers, with SmolLM2-135M shapes (9 query /
3 KV heads, head_dim 64) and Qwen2.5-1.5B shapes (12 / 2, head_dim 128), batch 1 and
8; prints the median milliseconds per selection for each policy and the memory its
block state takes for one request's blocks (summaries: the store indexed by physical
block; per-request: H2O's accumulated mass, after the timed selections). For scale it also
times what one target decode step spends on attention alone over the same context
(one query token, every layer): a selection should cost far less than that, and a
real decode step also reads all the weights. On a shared, loaded machine pass
--threads 1: spinning intra-op threads make multi-threaded timings erratic.

Requests of a batch share one pool of physical blocks through different random
block tables (the contents only matter for timing), so memory stays at one request's
worth. The exact-mass policies (topk_oracle, h2o) keep a copy of every key; the
benchmark stores it in bfloat16 to halve that (they are reference policies). `rerank` reads
its shortlist's keys from vLLM's own KV cache (engine/paged_keys.py): here a random bfloat16
cache in CPU_ATTN's layout (the logical one on other devices), one layer's reused for every
layer, not counted as the policy's memory (vLLM allocates it anyway).

    python -m vllm_triforce.tools.bench.selection_bench            # full (about a minute)
    python -m vllm_triforce.tools.bench.selection_bench --quick    # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_triforce.config import POLICY_NAMES

# The timing itself (torch, the core's policies) is in selection_timing.py, imported by
# `run`: `vllm-triforce` builds this module's parser for every command.


@dataclass(frozen=True)
class Shape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = (Shape("smollm2-135m", 9, 3, 64), Shape("qwen2.5-1.5b", 12, 2, 128))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--tokens", type=int, default=32768, help="committed tokens per request")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096, help="middle-level budget in tokens")
    # The engine's retrieval_sink_blocks / retrieval_recent_blocks (config.BlockCounts).
    parser.add_argument("--retrieval-sink-blocks", "--sink-blocks", type=int, default=1,
                        dest="retrieval_sink_blocks")
    parser.add_argument("--retrieval-recent-blocks", "--recent-blocks", type=int, default=4,
                        dest="retrieval_recent_blocks")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    names = sorted(POLICY_NAMES) + sorted(VARIANTS)
    parser.add_argument("--policies", nargs="+", default=names, choices=names)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


# name -> (policy, kwargs, coded summaries): configurations timed besides each policy's
# defaults (float summaries): key_variance, and key_variance with compact_summaries (the
# engine's default, read back from one byte a value)
VARIANTS = {"retrieval_var": ("retrieval", {"variance": True}, False),
            "retrieval_var_coded": ("retrieval", {"variance": True}, True)}


def run(args: argparse.Namespace) -> None:
    """Print the cost table for parsed arguments (`add_arguments`)."""
    import torch

    from vllm_triforce.tools.bench.selection_timing import time_attention_floor, time_selection

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.tokens, args.layers, args.budget, args.batch, args.repeat = 2048, 4, 512, [1, 2], 2
    print(f"selection cost: {args.tokens} tokens, block {args.block_size}, {args.layers} layers, "
          f"budget {args.budget} tokens ({args.retrieval_sink_blocks} sink + {args.retrieval_recent_blocks} recent "
          f"blocks), device {args.device}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    print(f"{'shape':<14} {'batch':>5} {'policy':<13} {'ms/selection':>12} "
          f"{'summary MiB':>11} {'per-req MiB':>11}")
    for shape in SHAPES:
        for batch in args.batch:
            for name in args.policies:
                ms, store, per_request = time_selection(name, shape, args, batch)
                print(f"{shape.name:<14} {batch:>5} {name:<13} {ms:>12.2f} "
                      f"{store / 2**20:>11.2f} {per_request / 2**20:>11.2f}", flush=True)
            floor = time_attention_floor(shape, args, batch)
            print(f"{shape.name:<14} {batch:>5} {'(attn/step)':<13} {floor:>12.2f}"
                  "   <- target decode step, attention only", flush=True)


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
