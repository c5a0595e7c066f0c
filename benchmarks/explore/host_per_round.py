"""Host ms per middle round by batch size: TriForce's own work a GPU cannot hide (issue #51).

A target whose compute is negligible (a 30-layer Llama of hidden size 64 and a 1,024-token
vocabulary, built here, tests/tiny_models.py), two levels, every request past a tiny
retrieval budget, drafting forced at a fixed depth (`set_fixed_depth`), greedy, one engine
of max_num_seqs = the largest batch. Host ms per round = (time in `propose` - time in
model forwards) / middle rounds (engine/stats.py `host_ms_per_round`), over the timed
generations; commit, selection and hand-off are in it, spread over the step's rounds. The
target: the largest batch at most 1.5 times the smallest.

    .venv/bin/python benchmarks/explore/host_per_round.py [--batches 8 32 64 128]
        [--depth 4] [--repeats 3] [--out benchmarks/host_per_round_2026-11-27]

Prints a table and writes results.json and results.md into --out.
"""

import argparse
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
    parser.add_argument("--depth", type=int, default=4, help="set_fixed_depth(k)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "host_per_round_2026-11-27")
    args = parser.parse_args()

    import tiny_models
    from vllm import SamplingParams

    from vllm_triforce.offline import drafter_of, in_process_llm

    tmp = Path(tempfile.mkdtemp(prefix="host_per_round_"))
    target = tiny_models.build_tiny_llama(tmp / "target", num_layers=30, hidden=64, heads=2,
                                          kv_heads=2, vocab_size=1024)
    llm = in_process_llm(target, SPEC, dtype="float32", enforce_eager=True, block_size=32,
                         max_model_len=1024, max_num_seqs=max(args.batches), seed=0)
    drafter = drafter_of(llm)
    drafter.set_fixed_depth(args.depth)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in args.batches:
        prompts = [tiny_models.make_text(args.prompt_words, seed=i) for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        rows.append(measure(llm, drafter, prompts, params, batch, args.repeats))
        print(f"batch {batch:4d}: host ms per middle round {rows[-1]['host_ms_per_round']:.2f} "
              f"(repeats {', '.join(f'{h:.2f}' for h in rows[-1]['repeats'])})", flush=True)
    results = {"config": {**vars(args), "out": str(args.out), "spec": SPEC,
                          "target": "tiny Llama: 30 layers, hidden 64, 2 heads, V 1024",
                          "machine": machine(), "cap": drafter.depth.max_drafting},
               "rows": rows}
    write(args.out, results)


def measure(llm, drafter, prompts, params, batch: int, repeats: int) -> dict:
    """Host ms per round over `repeats` timed generations of `prompts` (median)."""
    host_ms, wall, rounds = [], [], []
    for _ in range(repeats):
        before = drafter.stats.snapshot()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall.append(time.perf_counter() - start)
        after = drafter.stats.snapshot()
        d = {k: after[k] - before[k] for k in COUNTERS}
        assert d["top_proposed"] > 0, "TriForce never drafted"
        host_ms.append(1000 * (d["middle_seconds"] - d["forward_seconds"]) / d["middle_rounds"])
        rounds.append(d["middle_rounds"])
    return {"batch": batch, "host_ms_per_round": statistics.median(host_ms),
            "repeats": host_ms, "middle_rounds": rounds,
            "generate_s": statistics.median(wall)}


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown"
    return f"{name}, {os.cpu_count()} CPUs"


def write(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rows, config = results["rows"], results["config"]
    smallest = rows[0]["host_ms_per_round"]
    lines = ["# Host ms per middle round by batch size", "",
             f"{config['target']}, two levels, fixed depth {config['depth']}, greedy, "
             f"{config['prompt_words']}-word prompts past a {SPEC['retrieval_budget']}-token "
             f"budget, {config['max_tokens']} new tokens; median of {config['repeats']} "
             f"generations; {config['machine']}; drafting cap {config['cap']}.", "",
             f"    .venv/bin/python benchmarks/explore/host_per_round.py --batches "
             f"{' '.join(str(r['batch']) for r in rows)} --depth {config['depth']}", "",
             "| batch | host ms / round | vs smallest batch | middle rounds | generate s |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['host_ms_per_round']:.2f} | "
                     f"{r['host_ms_per_round'] / smallest:.2f}x | {r['middle_rounds'][0]} | "
                     f"{r['generate_s']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))


if __name__ == "__main__":
    main()
