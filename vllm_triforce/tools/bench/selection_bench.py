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
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.policies import POLICIES, make_policy
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.tables import build_block_tables
from vllm_triforce.engine.paged_keys import PagedKeys


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
    names = sorted(POLICIES) + sorted(VARIANTS)
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


def make_inputs(shape: Shape, args, batch: int, keep_keys: bool, keep_bounds: bool = False,
                keep_variance: bool = False, coded: bool = False):
    """Summaries filled with random full blocks + per-request tables and queries."""
    bs, device = args.block_size, torch.device(args.device)
    num_blocks = args.tokens // bs + 1  # room for the query token of the next pass
    summaries = BlockSummaries(args.layers, num_blocks + 1, shape.num_kv_heads, shape.head_dim, bs,
                               device=device, keep_keys=keep_keys, key_dtype=torch.bfloat16,
                               keep_bounds=keep_bounds, keep_variance=keep_variance,
                               coded=coded)
    store_shape = (args.layers, num_blocks + 1, shape.num_kv_heads, shape.head_dim)
    stores = [(summaries.sums, torch.randn(store_shape, device=device))]
    if summaries.square_deviations is not None:
        stores.append((summaries.square_deviations,
                       torch.randn(store_shape, device=device).abs_()))
    for store, values in stores:
        if coded:
            store.fill_(values)  # `CodedStore.fill_`: every block coded
        else:
            store.copy_(values)
    if summaries.mins is not None:
        summaries.mins.normal_()
        summaries.maxs.copy_(summaries.mins + summaries.maxs.normal_().abs())
    summaries.counts.fill_(bs)
    if summaries.keys is not None:
        summaries.keys.normal_()
    table = torch.stack([torch.randperm(num_blocks + 1, device=device)[:num_blocks]
                         for _ in range(batch)]).to(torch.int32)  # [R, max_blocks]
    query = torch.randn(batch, args.layers, shape.num_q_heads, shape.head_dim, device=device)
    num_committed = torch.full((batch,), args.tokens, device=device)
    return summaries, table, query, num_committed


def paged_cache(shape: Shape, args, num_blocks: int) -> PagedKeys:
    """Keys as rerank reads them in the engine: from a [num_blocks, H, bs, 2D] KV cache."""
    device = torch.device(args.device)
    kv_cache = torch.randn(num_blocks, shape.num_kv_heads, args.block_size, 2 * shape.head_dim,
                           dtype=torch.bfloat16, device=device)
    layer = SimpleNamespace(kv_cache=kv_cache, num_kv_heads=shape.num_kv_heads,
                            head_size=shape.head_dim)
    layout = "cpu_transposed" if device.type == "cpu" else "logical"
    return PagedKeys([layer] * args.layers, layout, args.block_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeat: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def time_selection(policy_name: str, shape: Shape, args, batch: int) -> tuple[float, int, int]:
    """(median ms per selection, summary bytes of one request's blocks, per-request bytes)."""
    name, kwargs, coded = VARIANTS.get(policy_name, (policy_name, {}, False))
    policy = make_policy(name, **kwargs)
    summaries, table, query, num_committed = make_inputs(shape, args, batch, policy.needs_keys,
                                                         policy.needs_bounds, policy.needs_variance,
                                                         coded)
    rerank = policy.exact_stage  # reads keys from the paged cache
    keys = paged_cache(shape, args, summaries.num_blocks) if rerank else summaries
    states = [SelectionState() for _ in range(batch)]
    seq_lens = num_committed + 1
    blocks = BlockCounts(block_size=args.block_size, budget_blocks=args.budget // args.block_size,
                         retrieval_sink_blocks=args.retrieval_sink_blocks,
                         retrieval_recent_blocks=args.retrieval_recent_blocks)
    selector = Selector(policy, blocks, keys=keys)  # the engine's selection, step start

    def one_selection():
        choice = selector.choose(query, summaries, table, num_committed, states)
        return build_block_tables(choice.selection, table, seq_lens, args.block_size)

    ms = median_ms(one_selection, args.repeat, summaries.device)
    return ms, summaries.nbytes(), max(s.nbytes() for s in states)


def time_attention_floor(shape: Shape, args, batch: int) -> float:
    """One decode step's attention over the whole context (one query token, all layers):
    grouped q.K^T, softmax, .V, reading each K/V once; one layer's K/V is reused for
    every layer to bound memory."""
    device = torch.device(args.device)
    kv_shape = (batch, shape.num_kv_heads, args.tokens, shape.head_dim)
    k, v = torch.randn(kv_shape, device=device), torch.randn(kv_shape, device=device)
    group = shape.num_q_heads // shape.num_kv_heads
    q = torch.randn(batch, shape.num_kv_heads, group, shape.head_dim, device=device)

    def step():
        for _ in range(args.layers):
            probs = (q @ k.transpose(-1, -2) / shape.head_dim ** 0.5).softmax(-1)  # [R, H, G, T]
            probs @ v

    return median_ms(step, args.repeat, device)


def run(args: argparse.Namespace) -> None:
    """Print the cost table for parsed arguments (`add_arguments`)."""
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
