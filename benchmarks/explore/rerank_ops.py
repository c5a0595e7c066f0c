"""Aten operations a middle round's shortlist re-ranking dispatches, eager and compiled
(`compiled_selection`), at Llama-3.1-8B's KV shape (issue 59).

On a GPU each operation is a launch the host pays for; the H200 profile of 2026-11-29
(benchmarks/gpu/round_graph_ahead_2026-11-29/) found the re-ranking's chunked reads of the
coded summaries the busiest part of a graphed round. This builds coded summaries of
`--layers` layers x 8 KV heads x 128 channels for `--batch` requests of `--context`
tokens, keeps a shortlist as the step's selection does (factor 4, budget 4,096 tokens),
and re-ranks it `--repeats` times with fresh queries, counting the operations each
re-ranking dispatches (a TorchDispatchMode; the compiled graph, query to selection, runs
outside it and counts as one) and its wall time on this machine, in inference mode as the
engine runs. Needs only torch.

    .venv/bin/python benchmarks/explore/rerank_ops.py [--layers 8] [--batch 8]
        [--context 7680] [--repeats 3]
"""

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_triforce.config import BlockCounts  # noqa: E402
from vllm_triforce.core.compiled import CompiledFunction  # noqa: E402
from vllm_triforce.core.fused_reads import CompiledScores  # noqa: E402
from vllm_triforce.core.policies import make_policy  # noqa: E402
from vllm_triforce.core.selection import Selector  # noqa: E402
from vllm_triforce.core.summaries import BlockSummaries  # noqa: E402

KV_HEADS, HEAD_DIM, Q_HEADS, BLOCK = 8, 128, 32, 16


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=7680)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, reqs, per_req = args.layers, args.batch, args.context // BLOCK
    num_blocks = reqs * per_req + 16
    summaries = BlockSummaries(layers, num_blocks, KV_HEADS, HEAD_DIM, BLOCK,
                               keep_variance=True, coded=True)
    for start in range(0, num_blocks, 256):  # a slice of blocks' keys at a time
        ids = torch.arange(start, min(start + 256, num_blocks))
        summaries.set_blocks(ids, torch.randn(layers, ids.numel(), KV_HEADS, BLOCK, HEAD_DIM))
    blocks = BlockCounts(block_size=BLOCK, budget_blocks=4096 // BLOCK, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=8)
    selector = Selector(make_policy("retrieval", variance=True), blocks, shortlist_factor=4)
    table = torch.randperm(num_blocks)[:reqs * per_req].view(reqs, per_req)
    committed = torch.full((reqs,), args.context)
    query = torch.randn(reqs, layers, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    shortlist = selector.choose(query, summaries, table, committed,
                                keep_shortlist=True).shortlist
    print(f"{torch.__version__}: {reqs} x {args.context} tokens, {layers} layers x "
          f"{KV_HEADS} x {HEAD_DIM}, shortlist of {shortlist.logical.shape[-1]} blocks")
    compiled = CompiledScores(summaries, True, blocks, Q_HEADS)
    print(f"compiled in {compiled.warm_up():.1f} s")
    run = CompiledFunction.__call__

    def unwatched(self, *a, **kw):  # one operation: the compiled graph's launch
        Counting.current.ops["(the compiled graph)"] += 1
        with _disable_current_modes():
            return run(self, *a, **kw)

    CompiledFunction.__call__ = unwatched
    for label, kernels in (("eager", None), ("compiled", compiled)):
        selector.release_copies()
        selector.policy.compiled = kernels
        selector.choose(query, summaries, table, committed, shortlist=shortlist)  # its copy
        counts, seconds = [], []
        for _ in range(args.repeats):
            fresh = torch.randn(reqs, layers, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
            Counting.current = mode = Counting()
            start = time.perf_counter()
            with mode:
                selector.choose(fresh, summaries, table, committed, shortlist=shortlist)
            seconds.append(time.perf_counter() - start)
            counts.append(sum(mode.ops.values()))
        copy = "a copy of the listed summaries" if shortlist.copy is not None else "no copy"
        print(f"{label}: {statistics.median(counts)} operations a re-ranking, "
              f"{1000 * statistics.median(seconds):.0f} ms on this machine ({copy})")
    CompiledFunction.__call__ = run


if __name__ == "__main__":
    with torch.inference_mode():  # as vLLM runs the engine: its tensors are inference tensors
        main()
