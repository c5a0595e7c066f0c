"""The timing of `vllm-triforce bench selection` (selection_bench.py, which has the
arguments and prints the table): random block summaries, tables and queries of a shape, and
the median milliseconds of one block selection and of one decode step's attention."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.tables import build_block_tables
from vllm_triforce.engine.paged_keys import PagedKeys
from vllm_triforce.tools.bench.selection_bench import VARIANTS, Shape


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
