"""The hot path's device work at Llama-3.1-8B shapes: time, peak memory, syncs (issue 25).

Needs only torch (runs where vLLM is not installed). Shapes: 32 layers, 32 query heads,
8 KV heads, head dim 128, block 16, bf16 summaries with float32 key variance (the default
`retrieval` state), vocabulary 128,256, gamma2 6; requests of `--context` tokens each.
Each operation runs once to warm up, then `--repeats` times; it reports the median device
time (CUDA events), the host time of the calls (wall clock, the launches), the peak memory
it allocated beyond its inputs, and its syncs (SyncCounter; on CUDA under
`set_sync_debug_mode("error")` where the engine allows none).

`--shape host-overhead`: instead, the model and settings of host_overhead.py (30 layers,
2 KV heads x 32, float32, a 1K vocabulary, block 32, budget 256 tokens): there the host ms
of a round's parts are TriForce's own per-round overhead on this device.

    python3 benchmarks/explore/cuda_hot_path.py [--batch 8] [--context 32768]
        [--cache-blocks N] [--score-chunk-mib M] [--json F] [--shape S] [--profile] [--coded]

`--coded`: the engine's default coded summaries (`compact_summaries`), and the step's
selection and a middle re-selection once more with their scores from the compiled kernels
(`compiled_selection`, core/fused_reads.py): device and host ms, peak, syncs, beside the
eager chunked reads of the same summaries; then each of the two compiled functions called
alone (`bare_calls`): as the engine calls it, with its guards skipped, and on CUDA
captured as a CUDA graph and replayed (host ms, and whether the replay's output equals the
call's): what moving the selection into the round's graph would leave on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vllm_triforce.config import BlockCounts  # noqa: E402
from vllm_triforce.core import reads  # noqa: E402
from vllm_triforce.core.blocks import selection_sizes  # noqa: E402
from vllm_triforce.core.policies import make_policy  # noqa: E402
from vllm_triforce.core.selection import Selection, Selector  # noqa: E402
from vllm_triforce.core.summaries import BlockSummaries, committed_runs  # noqa: E402
from vllm_triforce.core.tables import (TableLayout, build_block_tables,  # noqa: E402
                                       laid_out_tables)
from vllm_triforce.core.verify import (GREEDY_TEMPERATURE, sample_tokens,  # noqa: E402
                                       sampling_probs, verify)
from vllm_triforce.engine.batch import StepBatch  # noqa: E402
from vllm_triforce.engine.middle import HandOffBuffer, MiddleLoop  # noqa: E402
from vllm_triforce.engine.device.transfer import to_device  # noqa: E402
from vllm_triforce.tools.bench.syncs import SyncCounter  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, VOCAB, GAMMA2 = 32, 32, 8, 128, 16, 128_256, 6
DTYPE = torch.bfloat16  # the model's, hence the key sums'
BUDGET, SINK_BLOCKS, RECENT_BLOCKS = 4096, 1, 8  # retrieval budget (tokens), its sink / recent
# --shape host-overhead: the model of benchmarks/explore/host_overhead.py (issue 25's "model
# whose compute is negligible": 30 layers, 2 KV heads x 32, float32, a 1K vocabulary) with
# its TriForce settings (block 32, budget 256 tokens, 32 sink and 64 recent tokens)
SHAPES = {"llama-3.1-8b": {},
          "host-overhead": dict(LAYERS=30, Q_HEADS=2, KV_HEADS=2, HEAD_DIM=32, BLOCK=32,
                                VOCAB=1024, DTYPE=torch.float32, BUDGET=256, SINK_BLOCKS=1,
                                RECENT_BLOCKS=2)}


def measure(name: str, fn, repeats: int, strict: bool, device: str, results: list) -> object:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with SyncCounter(device_type=device, strict=strict and device == "cuda") as counter:
        out = fn()  # (a compiled function runs eagerly under the counter's dispatch mode)
    syncs = counter.total
    if device == "cuda":  # the peak of the timed calls alone
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
        t0 = time.perf_counter()
        out = fn()
        host_ms.append(1000 * (time.perf_counter() - t0))
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            device_ms.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0
    row = {"op": name, "device_ms": statistics.median(device_ms) if device_ms else None,
           "host_ms": statistics.median(host_ms), "peak_extra_MiB": peak / 2**20,
           "syncs": syncs}
    results.append(row)
    dm = "-" if row["device_ms"] is None else f"{row['device_ms']:.3f}"
    print(f"{name:<52} device {dm:>8} ms  host {row['host_ms']:7.3f} ms  "
          f"peak +{row['peak_extra_MiB']:8.1f} MiB  syncs {syncs}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cache-blocks", type=int, default=0,
                        help="blocks in the whole KV cache (default: the batch's own + 64); "
                             "about 22,500 on an 80 GB GPU, 23,800 with compact "
                             "summaries (engine/memory.py)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's top operations of a sampled "
                             "middle loop")
    parser.add_argument("--coded", action="store_true",
                        help="the engine's default summaries (`compact_summaries`: one byte a "
                             "value), and the selections also by the compiled kernels "
                             "(`compiled_selection`, core/fused_reads.py)")
    parser.add_argument("--score-chunk-mib", type=int, default=0,
                        help="override core/reads.SCORE_CHUNK_BYTES (MiB; 0: keep 64)")
    args = parser.parse_args()
    globals().update(SHAPES[args.shape])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if args.score_chunk_mib:
        reads.SCORE_CHUNK_BYTES = args.score_chunk_mib * 2**20
    torch.manual_seed(0)
    R, n = args.batch, args.context
    per_req = -(-(n + 64) // BLOCK)
    num_blocks = max(R * per_req + 64, args.cache_blocks)
    print(f"{device} {torch.cuda.get_device_name() if device == 'cuda' else ''} torch "
          f"{torch.__version__}: batch {R} x {n} tokens, {num_blocks} blocks, "
          f"{args.shape} shapes", flush=True)
    table = torch.randperm(num_blocks, device=dev)[:R * per_req].view(R, per_req).int()
    summaries = BlockSummaries(LAYERS, num_blocks, KV_HEADS, HEAD_DIM, BLOCK,
                               dtype=DTYPE, device=dev, keep_variance=True, coded=args.coded)
    if args.coded:  # written a slice of blocks at a time (each coded from float32)
        for start in range(0, num_blocks, 1024):
            ids = torch.arange(start, min(start + 1024, num_blocks), device=dev)
            shape = (LAYERS, ids.numel(), KV_HEADS, HEAD_DIM)
            summaries.sums.write(ids, torch.randn(shape, device=dev))
            summaries.square_deviations.write(ids, torch.rand(shape, device=dev))
    else:
        summaries.sums.normal_()
        summaries.square_deviations.uniform_()
    summaries.counts.fill_(BLOCK)
    blocks = BlockCounts(block_size=BLOCK, budget_blocks=BUDGET // BLOCK,
                         retrieval_sink_blocks=SINK_BLOCKS, retrieval_recent_blocks=RECENT_BLOCKS)
    selector = Selector(make_policy("retrieval", variance=True), blocks, shortlist_factor=4)
    results: list[dict] = []
    committed = [n] * R
    query = torch.randn(R, LAYERS, Q_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)

    new = GAMMA2 + 1  # one verification committing every draft and the bonus token
    keys = [torch.randn(R * new, KV_HEADS * HEAD_DIM, device=dev, dtype=DTYPE)
            for _ in range(LAYERS)]

    def commit():
        positions, owners, runs, num_runs = committed_runs(range(R), [n - new] * R, [new] * R,
                                                           BLOCK)
        rows, owners, positions, runs = to_device(dev, range(R * new), owners, positions, runs)
        summaries.add_committed(keys, rows, table[owners, positions // BLOCK].long(),
                                positions % BLOCK, (runs, num_runs))

    measure(f"commit: fold {R}x{new} tokens x {LAYERS} layers", commit, args.repeats, True, device,
            results)
    # the lazy summaries' unit of work (engine/summary_keeper.py): the blocks whose keys,
    # every layer's in float32, fill SCORE_CHUNK_BYTES
    lazy = reads.SCORE_CHUNK_BYTES // (LAYERS * KV_HEADS * BLOCK * HEAD_DIM * 4)
    lazy = min(lazy, table.shape[1])
    lazy_ids = table[0, :lazy]
    lazy_keys = torch.randn(LAYERS, lazy, KV_HEADS, BLOCK, HEAD_DIM, device=dev)
    measure(f"lazy summaries: set {lazy} blocks x {LAYERS} layers", lambda: summaries.set_blocks(
        lazy_ids, lazy_keys), args.repeats, True, device, results)
    del lazy_keys
    committed_dev = to_device(dev, committed)[0]
    choice = measure(f"select: score {R} x {per_req} blocks, keep shortlist",
                     lambda: selector.choose(query, summaries, table, committed_dev,
                                             keep_shortlist=True),
                     args.repeats, True, device, results)
    again = measure(f"re-select in the middle: shortlist of {choice.shortlist.logical.shape[-1]}",
                    lambda: selector.choose(query, summaries, table, committed_dev,
                                            shortlist=choice.shortlist),
                    args.repeats, True, device, results)
    if args.coded:
        compiled_selections(query, summaries, table, committed_dev, selector, choice,
                            args.repeats, device, results)
    sizes = [selection_sizes(c, blocks) for c in committed]
    ends = [c + GAMMA2 + 1 for c in committed]
    width = max(s + -(-e // BLOCK) - t for (s, t), e in zip(sizes, ends))

    def tables():
        sel, tails, ends_dev = to_device(dev, [s for s, _ in sizes], [t for _, t in sizes],
                                         ends)
        return build_block_tables(Selection(again.selection.logical_blocks, sel, tails),
                                  table, ends_dev, BLOCK, width)

    measure(f"tables: {LAYERS} layers x {R} x {width} on the device", tables, args.repeats,
            True, device, results)
    logical = again.selection.logical_blocks  # [R, L, max_selected]

    def laid_out():  # the engine's path (RetrievalStep.forward): host sizes, device layout
        layout = TableLayout.of([s for s, _ in sizes], [t for _, t in sizes], ends, BLOCK)
        n, start, tails = to_device(dev, layout.num_selected, layout.tail_start,
                                    layout.num_tails)
        return laid_out_tables(logical, table, n, start, tails, layout.width)

    measure(f"laid-out tables: {LAYERS} layers x {R} (host sizes)", laid_out, args.repeats,
            True, device, results)
    copied_reselect(dev, device, query, summaries, table, committed_dev, blocks, args.repeats,
                    results)

    rows_v = R * (GAMMA2 + 1)
    logits = torch.randn(rows_v, VOCAB, device=dev, dtype=DTYPE) * 3
    temperature = torch.full((rows_v,), 0.8, device=dev)
    top_k = torch.zeros(rows_v, dtype=torch.long, device=dev)
    top_p = torch.full((rows_v,), 0.9, device=dev)
    probs = measure(f"sampling probs, top-p 0.9: {rows_v} rows x {VOCAB}",
                    lambda: sampling_probs(logits, temperature, top_k, top_p, all_greedy=False),
                    args.repeats, True, device, results)
    measure(f"sampling probs, temperature only: {rows_v} rows",
            lambda: sampling_probs(logits, temperature, None, None, all_greedy=False),
            args.repeats, True, device, results)
    target = probs.view(R, GAMMA2 + 1, VOCAB)
    draft_probs = torch.softmax(torch.randn(R, GAMMA2, VOCAB, device=dev), -1)
    draft_ids = torch.randint(0, VOCAB, (R, GAMMA2), device=dev)
    num_drafts = to_device(dev, [GAMMA2] * R)[0]
    greedy = torch.zeros(R, dtype=torch.bool, device=dev)
    measure(f"verify, sampled: {R} x {GAMMA2} drafts",
            lambda: verify(draft_ids, draft_probs, target, num_drafts, greedy, None,
                           all_greedy=False),
            args.repeats, True, device, results)
    shared = torch.Generator(device=dev).manual_seed(0)
    measure(f"sample_tokens: {R} rows x {VOCAB}",
            lambda: sample_tokens(probs[:R], greedy, [None] * R, shared),
            args.repeats, True, device, results)
    middle_rounds(dev, device, R, args.repeats, results, args.profile)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                         "batch": R, "context": n, "results": results},
                                        indent=1))


def compiled_selections(query, summaries, table, committed, selector, choice, repeats: int,
                        device: str, results: list) -> None:
    """`compiled_selection` (core/fused_reads.py): the step's selection with its scores
    from the compiled kernel, and a middle re-selection as one compiled graph (query to
    selection), after their compilation
    (timed): against the two rows above, which read the coded summaries eagerly, in
    chunks."""
    from vllm_triforce.core.fused_reads import CompiledScores

    compiled = CompiledScores(summaries, True, selector.blocks, Q_HEADS)
    seconds = compiled.warm_up()
    print(f"{'':<52} compiled in {seconds:.1f} s", flush=True)
    results.append({"op": "compiled_selection: compilation", "seconds": seconds})
    selector.release_copies()
    selector.policy.compiled = compiled
    try:
        measure(f"select, compiled: {table.shape[0]} x {table.shape[1]} blocks",
                lambda: selector.choose(query, summaries, table, committed,
                                        keep_shortlist=True),
                repeats, True, device, results)
        measure(f"re-select in the middle, compiled: shortlist of "
                f"{choice.shortlist.logical.shape[-1]}",
                lambda: selector.choose(query, summaries, table, committed,
                                        shortlist=choice.shortlist),
                repeats, True, device, results)
        assert selector.policy.compiled is compiled, "the compiled kernels fell back"
        bare_calls(compiled, "_tables", "block scores",
                   lambda: selector.choose(query, summaries, table, committed,
                                           keep_shortlist=True), repeats, device, results)
        bare_calls(compiled, "_listed", "re-rank",
                   lambda: selector.choose(query, summaries, table, committed,
                                           shortlist=choice.shortlist), repeats, device, results)
    finally:
        selector.policy.compiled = None


def bare_calls(compiled, attribute: str, name: str, select, repeats: int, device: str,
               results: list) -> None:
    """One compiled function of `compiled` (`CompiledScores._tables`: a step's block
    scores; `_listed`: a middle round's re-ranking) called alone, with the arguments
    `select` passed it: its host and device ms as the engine calls it (dynamo's frame, its
    guards, the compiled wrapper's launches), with the guards skipped
    (`set_stance(skip_guard_eval_unsafe=True)`), and on CUDA captured once as a CUDA graph
    and replayed, with whether the replay's output equals the call's. What is left on the
    host if the selection moves into the round's graph (issue 59: a round's two compiled
    launches took 1.29 ms of host time on an H200, its replays 1.71 ms of device time)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    function = getattr(compiled, attribute)
    seen = {}

    def spy(*args, **kwargs):
        seen["args"] = args
        return function(*args, **kwargs)

    setattr(compiled, attribute, spy)
    try:
        select()
    finally:
        setattr(compiled, attribute, function)
    args = seen["args"]
    want = measure(f"{name}: the compiled call alone", lambda: function(*args), repeats,
                   False, device, results)

    def unguarded():
        if _get_current_dispatch_mode() is not None:  # measure's sync counter: as the call
            return function.eager(*args)
        with torch.inference_mode(), torch.compiler.set_stance(
                "fail_on_recompile", skip_guard_eval_unsafe=True):
            return function._compiled(*args)

    got = measure(f"{name}: the call, guards skipped", unguarded, repeats, False, device,
                  results)
    results[-1]["equal"] = bool(torch.equal(got, want))
    if device != "cuda":
        return
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            function(*args)  # warm-up off the capture's stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = function(*args)
    except Exception as exc:  # noqa: BLE001 - the probe reports what capture refuses
        results.append({"op": f"{name}: the call as a CUDA graph",
                        "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(f"{name}: capture failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return
    got = measure(f"{name}: the call as a CUDA graph, replayed",
                  lambda: (graph.replay(), out)[1], repeats, False, device, results)
    results[-1]["equal"] = bool(torch.equal(got, want))
    print(f"{'':<52} equal to the call: {results[-1]['equal']}", flush=True)


def copied_reselect(dev, device: str, query, summaries, table, committed, blocks,
                    repeats: int, results: list) -> None:
    """A middle re-selection from the shortlist's copy (`RetrievalPolicy.listed_copy`): the
    first re-ranking of a step copies the listed summaries (float32, divided by counts) when
    they fit SCORE_CHUNK_BYTES; the next ones read only the copy. At these shapes a copy fits
    one request with a shortlist of at most ~250 blocks (a 4K context), so this takes the
    first request and a shortlist of the engine's default size capped to fit."""
    per_block = 4 * 2 * KV_HEADS * HEAD_DIM * LAYERS  # float32 mean key and variance
    size = min(reads.SCORE_CHUNK_BYTES // per_block, blocks.num_retrieved * 4)
    one = Selector(make_policy("retrieval", variance=True), blocks,
                   shortlist_factor=max(1, size // blocks.num_retrieved))
    q, t, c = query[:1], table[:1], committed[:1]
    choice = one.choose(q, summaries, t, c, keep_shortlist=True)
    listed = choice.shortlist.logical.shape[-1]

    def first():  # copy, then score from it
        one.release_copies()
        return one.choose(q, summaries, t, c, shortlist=choice.shortlist)

    measure(f"re-select, 1 request, copying {listed} listed", first, repeats, True, device,
            results)
    measure(f"re-select, 1 request, from the copy of {listed}",
            lambda: one.choose(q, summaries, t, c, shortlist=choice.shortlist), repeats, True,
            device, results)
    print(f"{'':<52} copy held: {choice.shortlist.copy is not None}", flush=True)
    one.release_copies()


def middle_rounds(dev, device: str, R: int, repeats: int, results: list,
                  profile: bool = False) -> None:
    """The real MiddleLoop, two levels (the retrieval level drafting alone, one token per
    request per round, depth GAMMA2), over a stand-in retrieval level whose logits are a
    rank-64 product (so the round's own work dominates): host ms per round."""
    emb = torch.randn(VOCAB, 64, device=dev, dtype=DTYPE)
    out = torch.randn(64, VOCAB, device=dev, dtype=DTYPE)

    class RetrievalStep:  # engine/retrieval_level.RetrievalStep's interface
        def __init__(self, batch, states):
            self.batch, self.states = batch, states

        def forward(self, rows, token_ids, positions):
            if not isinstance(token_ids, torch.Tensor):  # the flat ids, on the host
                token_ids = to_device(dev, token_ids)[0]
            return emb[token_ids] @ out

        def load_ahead(self, *args):  # no round graphs here: nothing to load
            pass

        def launch_ahead(self):
            pass

        def select_in_middle(self, *args):
            pass

        def reselect_and_load(self, *args):  # no selection graphs either
            return False

    class Stats:
        rounds = 0

        def add(self, middle_rounds=0, **_):
            Stats.rounds += middle_rounds

        def record_middle(self, *args):
            pass

    for label, temp in (("greedy", 0.0), ("sampled, top-p 0.9", 0.8)):
        batch = StepBatch(
            req_ids=[str(r) for r in range(R)], seq_lens=[100] * R,
            query_start_loc=list(range(R + 1)), num_rejected=[0] * R, decoding=[True] * R,
            next_tokens=list(range(1, R + 1)), verify_ids=[0] * R, greedy=[temp == 0] * R,
            block_table=torch.zeros(R, 8, dtype=torch.int32, device=dev),
            temperature=torch.full((R,), temp, device=dev), top_k=None,
            top_p=torch.full((R,), 0.9, device=dev), requests=[None] * R)
        loop = MiddleLoop(None, 0, types.SimpleNamespace(
            record_rounds=lambda *a: None), Stats(), torch.Generator(device=dev).manual_seed(0),
            False)
        states = [types.SimpleNamespace(generator=None, refresh=None)
                  for _ in range(R)]

        buffer = HandOffBuffer(R, GAMMA2, VOCAB, dev)

        def run():
            return loop.run(RetrievalStep(batch, states), list(range(R)), [GAMMA2] * R,
                            buffer)

        before = len(results)
        measure(f"middle loop, 2 levels, {label}: {GAMMA2} rounds", run, repeats, False,
                device, results)
        row = results[before]
        row["per_round_host_ms"] = row["host_ms"] / GAMMA2
        print(f"{'':<52} = {row['per_round_host_ms']:.3f} ms per round (host), "
              f"{row['syncs']} syncs = {row['syncs'] / GAMMA2:.0f} per round", flush=True)
        assert GREEDY_TEMPERATURE > 0
        if profile and temp > 0:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                                   if device == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                run()
            key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)


if __name__ == "__main__":
    main()
