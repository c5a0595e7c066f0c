"""Host ms per middle round by batch size: TriForce's own work a GPU cannot hide (issue #51).

A target whose compute is negligible (a Llama of hidden size 64, 2 KV heads and a
1,024-token vocabulary, built here, tests/tiny_models.py), two levels, every request past a
tiny retrieval budget, drafting forced at a fixed depth (`set_fixed_depth`), greedy, one
engine per configuration of max_num_seqs = the largest batch. Host ms per round = (time in
`propose` - time in model forwards) / middle rounds (engine/stats.py `host_ms_per_round`),
over the timed generations; commit, selection and hand-off are in it, spread over the
step's rounds. The target: the largest batch at most 1.5 times the smallest.

On a CPU that time also holds the tensor work outside the model (selection scores, table
layout, argmax), which a GPU runs asynchronously: it grows with the batch and with the
layers the selection scores. So each configuration (`--configs LAYERS:REFRESH_INTERVAL`)
is measured: 30 layers re-selecting between rounds (refresh_interval 1, the default: most
of that tensor work) and 2 layers never re-selecting (0: little of it, mostly Python).
Beside the time, over further generations of the same prompts:
  * the Python lines the proposer runs per round outside the model forwards, traced
    (`python_lines_per_round`): a count that neither the machine's load nor the CPU's
    tensor work moves;
  * the aten operations per round outside the model forwards (`aten_ops_per_round`; each
    one a kernel launch on a GPU) and the time spent inside them (`kernel_ms_per_round`,
    median of `--repeats` // 2 generations under a TorchDispatchMode that times each one):
    on a CPU that is the tensor work a GPU would run on the device, asynchronously.
    `host_ms_per_round` less it (`host_less_kernels_ms`) is what a GPU's host would still
    do per round besides the launches; a difference of two medians, so it carries both
    medians' noise. Call sites: benchmarks/explore/host_overhead.py `--ops`;
  * the host's speed after a forward (`fixed_work_us`): a fixed piece of host work
    (`fixed_host_work`: Python, numpy and small torch operations, the same at every batch)
    timed right after each model forward, median over one generation. On a CPU the same
    host work takes longer after a larger batch's forward (the model's work shares the
    host's cores and caches: 1.0-2.4x at batch 128 against batch 8 on a 2-core EPYC,
    varying between runs, so it is shown, not used to scale the other figures); a GPU's
    model work leaves the host alone.

On a GPU (bfloat16 there by default, `--dtype`) the model's work and the tensor kernels run
on the device and `host_ms_per_round` is the host's own work and launches: the figure the
issue's target is about, measured directly. From a lent machine's bundle
(benchmarks/gpu/README.md):

    bash scripts/gpu_run.sh -- python3 $PWD/benchmarks/explore/host_per_round.py \
        --out $OUT/host_per_round

    .venv/bin/python benchmarks/explore/host_per_round.py [--batches 8 32 64 128]
        [--configs 30:1 2:0] [--depth 4] [--repeats 7] [--round-graphs]
        [--compiled-selection] [--selection-graphs] [--sites N]
        [--out benchmarks/host_per_round_2026-11-28]

`--round-graphs`: the middle passes over persistent buffers (each bucket's replay counted
as the model's, like a forward; on a GPU, CUDA graphs). `--compiled-selection`: the
selection's host work as compiled functions (`compiled_selection`; each call counted as
one launch). `--selection-graphs` (with both): a round's re-selection and the next pass's
load as one graph (`selection_graphs`; each run counted as one launch, its time as tensor
work: on a CPU the closure runs there).

Prints a table per configuration and writes results.json and results.md into --out.
"""

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

SPEC = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 128,
        "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 32, "adaptive": False}
COUNTERS = ("middle_seconds", "forward_seconds", "middle_rounds", "top_proposed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--configs", nargs="+", default=["30:1", "2:0"],
                        help="LAYERS:REFRESH_INTERVAL of each engine measured")
    parser.add_argument("--depth", type=int, default=4, help="set_fixed_depth(k)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dtype", default=None,
                        help="the model's (default: float32 on a CPU, bfloat16 on a GPU, "
                             "where the stock attention backends take no float32)")
    parser.add_argument("--round-graphs", action="store_true",
                        help="the middle passes over persistent buffers (`round_graphs`)")
    parser.add_argument("--compiled-selection", action="store_true",
                        help="the block scores, re-ranking and pass layout compiled "
                             "(`compiled_selection`)")
    parser.add_argument("--selection-graphs", action="store_true",
                        help="a round's re-selection and the next pass's load as one graph "
                             "(`selection_graphs`; with both flags above)")
    parser.add_argument("--sites", type=int, default=0, metavar="N",
                        help="also print the N Python lines and the N aten operations whose "
                             "count per round grows most from the smallest batch to the "
                             "largest (what scales with the batch)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for results.json and results.md (the committed run "
                             "is benchmarks/host_per_round_2026-11-28/)")
    args = parser.parse_args()
    if args.dtype is None:
        import torch
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    tables, setup = [], {**vars(args), "out": str(args.out), "spec": SPEC, "machine": machine()}
    for config in args.configs:  # written as each engine's table completes
        layers, refresh = (int(part) for part in config.split(":"))
        tables.append(measure_engine(args, layers, refresh))
        write(args.out, {"config": setup, "tables": tables})


def measure_engine(args, layers: int, refresh_interval: int) -> dict:
    """One engine: host ms per round (and operations per round) at every batch size."""
    import tiny_models
    from vllm import SamplingParams

    from vllm_triforce.offline import drafter_of, free_llm, in_process_llm

    tmp = Path(tempfile.mkdtemp(prefix="host_per_round_"))
    target = tiny_models.build_tiny_llama(tmp / "target", num_layers=layers, hidden=64,
                                          heads=2, kv_heads=2, vocab_size=1024)
    spec = {**SPEC, "refresh_interval": refresh_interval, "round_graphs": args.round_graphs,
            "compiled_selection": args.compiled_selection,
            "selection_graphs": args.selection_graphs}
    llm = in_process_llm(target, spec, dtype=args.dtype, enforce_eager=True, block_size=32,
                         max_model_len=1024, max_num_seqs=max(args.batches), seed=0)
    try:
        drafter = drafter_of(llm)
        drafter.set_fixed_depth(args.depth)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        rows = []
        for batch in args.batches:
            prompts = [tiny_models.make_text(args.prompt_words, seed=i) for i in range(batch)]
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)
            rows.append(measure(llm, drafter, prompts, params, batch, args.repeats))
            print(f"{layers} layers, refresh_interval {refresh_interval}, batch {batch:4d}: "
                  f"host ms per middle round {rows[-1]['host_ms_per_round']:.2f}, Python lines "
                  f"{rows[-1]['python_lines_per_round']:,.0f} (in the rounds "
                  f"{rows[-1]['round_lines_per_round']:,.0f}), aten ops "
                  f"{rows[-1]['aten_ops_per_round']:.0f}, of the ms in tensor kernels "
                  f"{rows[-1]['kernel_ms_per_round']:.2f}, fixed host work "
                  f"{rows[-1]['fixed_work_us']:.0f} us; steady steps: host ms per round "
                  f"{rows[-1]['steady_host_ms_per_round']:.2f}, Python lines "
                  f"{rows[-1]['steady_lines_per_round']:,.0f} (repeats "
                  f"{', '.join(f'{h:.2f}' for h in rows[-1]['repeats'])}; model forwards "
                  f"{rows[-1]['forward_ms_per_round']:.2f} ms)", flush=True)
        if args.sites:
            print_growth(rows, args.sites)
        for row in rows:  # per-site counts are for the print, not the results
            row.pop("line_sites"), row.pop("op_sites")
        return {"layers": layers, "refresh_interval": refresh_interval,
                "cap": drafter.depth.max_drafting, "rows": rows}
    finally:
        free_llm(llm)


def steady_steps(drafter, on_step):
    """Wraps `drafter.propose` so that `on_step(steady, host_seconds, rounds)` hears each
    step: `steady` when its requests are the last step's, every one decoding (no request
    came, went or prefilled: the steps between a batch's admission and its end).
    Returns a function that unwraps it."""
    propose, stats = drafter.propose, drafter.stats

    def observed(*args, **kwargs):
        last = drafter._last_batch
        middle, forward, rounds = stats.middle_seconds, stats.forward_seconds, stats.middle_rounds
        out = propose(*args, **kwargs)
        batch = drafter._last_batch
        steady = (last is not None and batch is not last and batch.req_ids == last.req_ids
                  and all(batch.decoding))
        on_step(steady, (stats.middle_seconds - middle) - (stats.forward_seconds - forward),
                stats.middle_rounds - rounds)
        return out

    drafter.propose = observed

    def unwrap():
        drafter.propose = propose
    return unwrap


def measure(llm, drafter, prompts, params, batch: int, repeats: int) -> dict:
    """Host ms per round over `repeats` timed generations of `prompts` (median), over all
    steps and over the steady ones (`steady_steps`)."""
    host_ms, forward_ms, wall, rounds, steady_ms, steady_rounds = [], [], [], [], [], []
    for _ in range(repeats):
        steady = {"seconds": 0.0, "rounds": 0}

        def on_step(is_steady, seconds, num_rounds):
            if is_steady:
                steady["seconds"] += seconds
                steady["rounds"] += num_rounds

        unwrap = steady_steps(drafter, on_step)
        before = drafter.stats.snapshot()
        start = time.perf_counter()
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            unwrap()
        wall.append(time.perf_counter() - start)
        after = drafter.stats.snapshot()
        d = {k: after[k] - before[k] for k in COUNTERS}
        assert d["top_proposed"] > 0, "TriForce never drafted"
        host_ms.append(1000 * (d["middle_seconds"] - d["forward_seconds"]) / d["middle_rounds"])
        forward_ms.append(1000 * d["forward_seconds"] / d["middle_rounds"])
        rounds.append(d["middle_rounds"])
        steady_ms.append(1000 * steady["seconds"] / max(steady["rounds"], 1))
        steady_rounds.append(steady["rounds"])
    ops, kernel_ms, op_sites = tensor_work_per_round(llm, drafter, prompts, params,
                                                     max(repeats // 2, 1))
    fixed_us = fixed_work_after_forwards(llm, prompts, params)
    lines, round_lines, steady_lines, line_sites = python_lines_per_round(
        llm, drafter, prompts, params)
    host = statistics.median(host_ms)
    return {"batch": batch, "host_ms_per_round": host,
            "repeats": host_ms, "forward_ms_per_round": statistics.median(forward_ms),
            "middle_rounds": rounds, "generate_s": statistics.median(wall),
            "python_lines_per_round": lines, "round_lines_per_round": round_lines,
            "aten_ops_per_round": ops, "kernel_ms_per_round": kernel_ms,
            "host_less_kernels_ms": host - kernel_ms, "fixed_work_us": fixed_us,
            "steady_host_ms_per_round": statistics.median(steady_ms),
            "steady_rounds": steady_rounds, "steady_lines_per_round": steady_lines,
            "line_sites": line_sites, "op_sites": op_sites}


def print_growth(rows: list[dict], n: int) -> None:
    """The `n` Python lines and aten operations whose count per middle round grows most
    from the smallest batch to the largest: a per-request loop shows as a line whose count
    grows with the batch."""
    first, last = rows[0], rows[-1]
    for key, what in (("line_sites", "Python lines"), ("op_sites", "aten operations")):
        growth = sorted(((last[key].get(site, 0.0) - first[key].get(site, 0.0), site)
                         for site in set(first[key]) | set(last[key])), reverse=True)
        print(f"  {what} per round growing most, batch {first['batch']} -> {last['batch']}:")
        for grew, site in growth[:n]:
            print(f"    {first[key].get(site, 0.0):8.1f} -> {last[key].get(site, 0.0):8.1f}  "
                  f"{site}")


def fixed_host_work() -> int:
    """The same host work at every batch: a Python loop and dict, small numpy and small
    torch operations (a few dozen microseconds)."""
    import numpy as np
    import torch

    total = sum(i * 2 for i in range(50))
    table = {i: i + 1 for i in range(20)}
    values, tensor = np.arange(16), torch.arange(16)
    for _ in range(5):
        total += int(values[values > 3].sum()) + int((tensor + 1)[tensor > 2].sum())
    return total + len(table)


def fixed_work_after_forwards(llm, prompts, params) -> float:
    """Median microseconds `fixed_host_work` takes right after each model forward of one
    generation (outside the forward's timing: it runs after the forward returned)."""
    import vllm_triforce.engine.device.forward as forward
    import vllm_triforce.engine.device.round_graph as round_graph

    times = []

    def then_fixed_work(model):
        def run_then_fixed_work(*args, **kwargs):
            out = model(*args, **kwargs)
            start = time.perf_counter()
            fixed_host_work()
            times.append(time.perf_counter() - start)
            return out
        return run_then_fixed_work

    run, closure = forward.run, round_graph.BucketPass.closure
    forward.run = then_fixed_work(run)
    round_graph.BucketPass.closure = then_fixed_work(closure)  # `--round-graphs`
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        forward.run, round_graph.BucketPass.closure = run, closure
    return 1e6 * statistics.median(times)


def inside(depth: dict, key: str, function):
    """`function`, with depth[key] one higher while a call of it runs (nested calls count)."""
    def counted(*args, **kwargs):
        depth[key] += 1
        try:
            return function(*args, **kwargs)
        finally:
            depth[key] -= 1
    return counted


def tensor_work_per_round(llm, drafter, prompts, params, repeats: int
                          ) -> tuple[float, float, dict]:
    """(aten operations per middle round outside the model forwards, ms per round inside
    them: median over `repeats` generations, and the last generation's operations per
    round by name), by tools/bench/host_ops.HostOps: each
    operation timed where it reaches the dispatcher, so the mode's own Python is not in
    the time. A round graph's launch is left out, as the model's forwards are (its time
    is the engine's forward time, which `host_ms_per_round` excludes already)."""
    from vllm_triforce.tools.bench.host_ops import GRAPH_LAUNCH, HostOps

    ops, kernel_ms = [], []
    for _ in range(repeats):
        before = drafter.stats.snapshot()["middle_rounds"]
        with HostOps(drafter) as counted:
            llm.generate(prompts, params, use_tqdm=False)
        rounds = drafter.stats.snapshot()["middle_rounds"] - before
        ops.append((counted.total - counted.counts[GRAPH_LAUNCH]) / rounds)
        kernel_ms.append(1000 * (sum(counted.seconds.values())
                                 - counted.seconds[GRAPH_LAUNCH]) / rounds)
    sites = {name: count / rounds for name, count in counted.counts.items()
             if name != GRAPH_LAUNCH}
    return statistics.median(ops), statistics.median(kernel_ms), sites


def python_lines_per_round(llm, drafter, prompts, params
                           ) -> tuple[float, float, float, dict]:
    """(Python lines the proposer runs per middle round outside the model forwards, of
    which inside the rounds: `MiddleLoop._round` and `RetrievalStep.select_in_middle`, per
    round of the steady steps, `steady_steps`, and per round by "file:line"), over one
    traced generation: counts no
    other process on the machine moves, of the host work that is Python's (a GPU's launches
    and the CPU's tensor work are not in it). The rest is the step's own work (the commit,
    the plan, the step-start selection, the hand-off), once a step whatever its rounds."""
    import vllm_triforce.engine.device.forward as forward
    import vllm_triforce.engine.device.round_graph as round_graph
    from vllm_triforce.engine.device.selection_graph import SelectionGraphs
    from vllm_triforce.engine.middle import MiddleLoop
    from vllm_triforce.engine.retrieval_level import RetrievalStep

    counted = {"on": False, "round": 0, "lines": 0, "round_lines": 0}
    sites = collections.Counter()

    def local(frame, event, arg):
        if event == "line" and counted["on"]:
            counted["lines"] += 1
            sites[frame.f_code.co_filename, frame.f_lineno] += 1
            counted["round_lines"] += counted["round"] > 0
        return local

    def untraced(model):
        def model_untraced(*args, **kwargs):
            counted["on"] = False
            try:
                return model(*args, **kwargs)
            finally:
                counted["on"] = True
        return model_untraced

    def traced(*args, **kwargs):
        counted["on"] = True
        sys.settrace(lambda frame, event, arg: local if counted["on"] else None)
        try:
            return propose(*args, **kwargs)
        finally:
            sys.settrace(None)
            counted["on"] = False

    steady = {"lines": 0, "rounds": 0, "before": 0}

    def on_step(is_steady, seconds, num_rounds):
        if is_steady:
            steady["lines"] += counted["lines"] - steady["before"]
            steady["rounds"] += num_rounds
        steady["before"] = counted["lines"]

    run, propose = forward.run, drafter.propose
    closure = round_graph.BucketPass.closure  # a round graph's model (`--round-graphs`)
    launch = SelectionGraphs.launch  # a selection graph's run (`--selection-graphs`)
    round_, select_in_middle = MiddleLoop._round, RetrievalStep.select_in_middle
    forward.run, drafter.propose = untraced(run), traced
    round_graph.BucketPass.closure = untraced(closure)
    SelectionGraphs.launch = untraced(launch)
    MiddleLoop._round = inside(counted, "round", round_)
    RetrievalStep.select_in_middle = inside(counted, "round", select_in_middle)
    unwrap = steady_steps(drafter, on_step)
    try:
        before = drafter.stats.snapshot()["middle_rounds"]
        llm.generate(prompts, params, use_tqdm=False)
        rounds = drafter.stats.snapshot()["middle_rounds"] - before
    finally:
        unwrap()
        forward.run, drafter.propose = run, propose
        round_graph.BucketPass.closure, SelectionGraphs.launch = closure, launch
        MiddleLoop._round, RetrievalStep.select_in_middle = round_, select_in_middle
    here = str(REPO) + os.sep
    return (counted["lines"] / rounds, counted["round_lines"] / rounds,
            steady["lines"] / max(steady["rounds"], 1),
            {f"{path.removeprefix(here)}:{line}": count / rounds
             for (path, line), count in sites.items()})


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown"
    import torch
    if torch.cuda.is_available():  # the host is the CPU, the device the GPU
        return f"{torch.cuda.get_device_name()}, host {name}, {os.cpu_count()} CPUs"
    return f"{name}, {os.cpu_count()} CPUs"


def write(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    config = results["config"]
    lines = ["# Host ms per middle round by batch size", "",
             f"Tiny Llama (hidden 64, 2 KV heads, V 1,024, {config.get('dtype', 'float32')}), "
             f"two levels, fixed depth {config['depth']}, greedy, "
             f"{config['prompt_words']}-word prompts past a "
             f"{SPEC['retrieval_budget']}-token budget, {config['max_tokens']} new tokens; "
             f"median of {config['repeats']} generations; {config['machine']}.", "",
             f"    .venv/bin/python benchmarks/explore/host_per_round.py --batches "
             f"{' '.join(map(str, config['batches']))} --configs {' '.join(config['configs'])} "
             f"--depth {config['depth']}"
             + (" --round-graphs" if config.get("round_graphs") else "")
             + (" --compiled-selection" if config.get("compiled_selection") else "")
             + (" --selection-graphs" if config.get("selection_graphs") else "")
             + f" --out {config['out']}"]
    for table in results["tables"]:
        rows = table["rows"]
        smallest = rows[0]["host_ms_per_round"]
        smallest_lines = rows[0]["python_lines_per_round"]
        lines += ["", f"## {table['layers']} layers, refresh_interval "
                      f"{table['refresh_interval']} (drafting cap {table['cap']})", "",
                  "| batch | host ms / round | vs smallest batch | of which tensor kernels ms | "
                  "host less kernels ms | vs smallest batch | steady steps: host ms / round | "
                  "vs smallest batch | fixed host work us | "
                  "aten ops / round | model forwards ms / round | middle rounds | generate s | "
                  "Python lines / round | vs smallest batch | of which in the rounds | "
                  "steady steps: Python lines / round | vs smallest batch |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        first = rows[0]
        for r in rows:
            lines.append(f"| {r['batch']} | {r['host_ms_per_round']:.2f} | "
                         f"{r['host_ms_per_round'] / smallest:.2f}x | "
                         f"{r['kernel_ms_per_round']:.2f} | {r['host_less_kernels_ms']:.2f} | "
                         f"{r['host_less_kernels_ms'] / first['host_less_kernels_ms']:.2f}x | "
                         f"{r['steady_host_ms_per_round']:.2f} | "
                         f"{r['steady_host_ms_per_round'] / first['steady_host_ms_per_round']:.2f}"
                         f"x | "
                         f"{r['fixed_work_us']:.0f} | {r['aten_ops_per_round']:.0f} | "
                         f"{r['forward_ms_per_round']:.2f} | {r['middle_rounds'][0]} | "
                         f"{r['generate_s']:.2f} | {r['python_lines_per_round']:,.0f} | "
                         f"{r['python_lines_per_round'] / smallest_lines:.2f}x | "
                         f"{r['round_lines_per_round']:,.0f} | "
                         f"{r['steady_lines_per_round']:,.0f} | "
                         f"{r['steady_lines_per_round'] / first['steady_lines_per_round']:.2f}x |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
