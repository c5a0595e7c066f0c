"""`vllm-triforce bench sweep`: TriForce two-level against plain vLLM while one knob varies.

Knobs (one PNG each, in the manner of the paper's Figures 5-6): temperature (0, 0.6, 1.0),
retrieval budget, block size (TriForce's chunk size = vLLM's KV block size), context length.
For every value: plain vLLM and two-level TriForce on the same Moby-Dick prompts; decode
tok/s, speedup, and the top-level accepted/proposed ratio. At temperature > 0 outputs are
sampled, so they are not compared.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vllm_triforce.tools.bench import prompts as bench_prompts
from vllm_triforce.tools.bench import report
from vllm_triforce.tools.bench.runner import run_methods

DEFAULTS = {"temperature": [0.0, 0.6, 1.0], "budget": [256, 512, 1024],
            "block_size": [32, 64, 128], "context": [2048, 4096, 8000]}
QUICK = {"temperature": [0.0, 1.0], "budget": [160, 224], "block_size": [32, 64],
         "context": [256, 384]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--knobs", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    p.add_argument("--prompt-tokens", type=int, default=4096, help="context when not swept")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=512, help="retrieval_budget when not swept")
    p.add_argument("--gamma", type=int, default=6)


def run_sweep(args, model: str, out: Path) -> dict:
    values = QUICK if args.quick else DEFAULTS
    if args.quick:
        args.prompt_tokens, args.batch, args.max_tokens, args.budget = 256, 1, 8, 192
    data, plain_runs = {}, {}
    for knob in args.knobs:
        points = [_point(args, model, out, knob, v, plain_runs) for v in values[knob]]
        data[knob] = points
        report.line_plot(out / f"sweep_{knob}.png", values[knob],
                         {"speedup vs plain": [p["speedup"] for p in points],
                          "top accepted/proposed": [p["acceptance"] or 0.0 for p in points]},
                         knob, "ratio", f"TriForce two-level: {knob} sweep")
    report.write_json(out / "results.json", data)
    header = ["knob", "value", "plain tok/s", "TriForce tok/s", "speedup",
              "accepted/proposed (full-cache verify)", "greedy identical"]
    rows = [[k, p["value"], p["plain_tok_s"], p["triforce_tok_s"], p["speedup"],
             p["acceptance"], p["identical"]] for k, pts in data.items() for p in pts]
    report.write_markdown(out / "results.md", "bench sweep", [
        f"Target `{Path(model).name}`, batch {args.batch}, {args.max_tokens} new tokens, "
        f"gamma={args.gamma}; defaults: context {args.prompt_tokens}, budget {args.budget}, "
        "block 32, greedy. `greedy identical` is n/a at temperature > 0.",
        report.markdown_table(header, rows)])
    return data


def _point(args, model: str, out: Path, knob: str, value, plain_runs: dict) -> dict:
    """One sweep point. Plain vLLM does not depend on the budget, so its run is shared by
    every point with the same context, block size and temperature (`plain_runs`)."""
    context = value if knob == "context" else args.prompt_tokens
    budget = value if knob == "budget" else args.budget
    block = value if knob == "block_size" else 32
    temperature = value if knob == "temperature" else 0.0
    # Fixed depth (adaptive off): a sweep shows how acceptance and speed move with one knob
    # at a given gamma; the depth controller would change the depth under it.
    spec = {"method": "triforce", "num_speculative_tokens": args.gamma, "adaptive": False,
            "retrieval_budget": max(budget, 5 * block)}
    job = {"model": model, "prompts": bench_prompts.book_prompts(model, context, args.batch),
           "max_tokens": args.max_tokens, "repeats": 1, "dtype": args.dtype, "temperature": temperature,
           "block_size": block,
           "max_model_len": context + args.max_tokens + 2 * args.gamma + 64}
    key = (context, block, temperature)
    runs = [{"name": f"{knob}-{value}-triforce2", "spec": spec}]
    if key not in plain_runs:
        runs.insert(0, {"name": f"{knob}-{value}-plain", "spec": None})
    results = run_methods(job, runs, out, isolate=not args.quick, desc=f"{knob}={value}")
    if key not in plain_runs:
        plain_runs[key] = results[0]
    plain, tri = plain_runs[key], results[-1]
    n = args.batch * args.max_tokens
    plain_tps = n / statistics.median(plain["decode_s"])
    tri_tps = n / statistics.median(tri["decode_s"])
    counters = tri["triforce"]
    return {"value": value, "plain_tok_s": plain_tps, "triforce_tok_s": tri_tps,
            "speedup": tri_tps / plain_tps, "counters": counters,
            "acceptance": _ratio(tri["vllm_spec"]),
            "identical": (plain["tokens"] == tri["tokens"]) if temperature == 0 else "n/a"}


def _ratio(spec: dict) -> float | None:
    drafted = spec.get("vllm:spec_decode_num_draft_tokens") or 0
    return (spec.get("vllm:spec_decode_num_accepted_tokens") or 0) / drafted if drafted else None
