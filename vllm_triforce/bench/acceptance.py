"""`vllm-triforce bench acceptance`: the paper's Table 1 on our data.

Rows: Moby-Dick passages and a needle-in-a-haystack task from the SOTU speeches (a
6-digit passphrase at 40% depth, the prompt ends asking for it). Columns: the four
selection policies of the retrieval cache (Top-K oracle, StreamingLLM, H2O, Retrieval),
retrieval budget ≈ 3% of the context (rounded to whole blocks, at least the minimum
the config allows). Reference: the target over its full cache.

Two quantities per cell, both from two-level TriForce (the target over its retrieval cache
drafts gamma tokens for the target over its full cache), sampled at the paper's setting
(temperature 0.6, top-p 0.9) unless told otherwise:
- **middle level, per token**: mean over measured positions of sum_x min(p(x), q(x)), p the
  target over its full cache and q over its retrieval cache, at each request's first
  middle position of every step (`measure_middle_acceptance`: one extra full-cache pass
  per step; that position's context is all committed, so p is exactly vLLM's);
- **TriForce's accepted / proposed**: vLLM's `spec_decode_num_accepted_tokens /
  num_draft_tokens` over the timed generation (whole drafts of gamma tokens: a rejection
  also discards the tokens after it, so this is lower than the per-token rate).
A greedy plain-vLLM run per task is the reference for "did the model find the needle".
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_triforce.bench import prompts as bench_prompts
from vllm_triforce.bench import report
from vllm_triforce.bench.runner import run_methods
from vllm_triforce.config import FULL_KEY_POLICIES

POLICIES = ("topk_oracle", "streamingllm", "h2o", "retrieval")
LABELS = {"topk_oracle": "Top-K oracle", "streamingllm": "StreamingLLM", "h2o": "H2O",
          "retrieval": "Retrieval"}
QUICK = dict(context_tokens=512, batch=1, max_tokens=16)
BLOCK = 32
MIN_BUDGET = 5 * BLOCK  # sink block + 2 recent blocks + tail + one retrieved block


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2, help="prompts per task")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget-fraction", type=float, default=0.03)
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, default=0.6,
                   help="sampling temperature of the TriForce runs (paper: 0.6)")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p of the TriForce runs (paper: 0.9)")
    p.add_argument("--tasks", nargs="+", default=["moby", "needle"], choices=["moby", "needle"],
                   help="rows: Moby-Dick passages, SOTU needle in a haystack")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                   help="columns (selection policies)")


def budget_for(context: int, fraction: float) -> int:
    return max(round(context * fraction / BLOCK) * BLOCK, MIN_BUDGET)


def run_acceptance(args, model: str, out: Path) -> dict:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    budget = budget_for(args.context_tokens, args.budget_fraction)
    needles = (bench_prompts.needle_prompts(model, args.context_tokens, args.batch)
               if "needle" in args.tasks else [])
    tasks = {}
    if "moby" in args.tasks:
        tasks["Moby-Dick"] = bench_prompts.book_prompts(model, args.context_tokens, args.batch)
    if needles:
        tasks["SOTU needle"] = [n["ids"] for n in needles]
    runs = [{"name": "reference", "spec": None, "temperature": 0.0}] + [
        {"name": p, "spec": {"method": "triforce", "num_speculative_tokens": args.gamma,
                             "retrieval_budget": budget, "selection_policy": p,
                             "measure_middle_acceptance": True,
                             "allow_full_key_copy": p in FULL_KEY_POLICIES}}
        for p in args.policies]
    all_runs = [{**run, "name": f"{slug}-{run['name']}", "prompts": ids}
                for slug, ids in zip([t for t in ("moby", "needle") if t in args.tasks],
                                     tasks.values()) for run in runs]
    job = {"model": model, "prompts": [], "max_tokens": args.max_tokens, "repeats": 1,
           "temperature": args.temperature, "top_p": args.top_p, "dtype": args.dtype,
           "max_model_len": args.context_tokens + args.max_tokens + 2 * args.gamma + 64}
    # --quick: one child process for all runs (start-up dominates tiny runs).
    results = run_methods(job, all_runs, out, isolate=not args.quick, desc="bench acceptance")
    table = {task: _summarize(results[i * len(runs):(i + 1) * len(runs)])
             for i, task in enumerate(tasks)}
    found = [n["passphrase"] in _decode(model, toks) for n, toks in
             zip(needles, table["SOTU needle"]["reference"]["tokens"])] if needles else None
    data = {"config": {"model": model, "context_tokens": args.context_tokens,
                       "batch": args.batch, "max_tokens": args.max_tokens, "gamma": args.gamma,
                       "temperature": args.temperature, "top_p": args.top_p, "dtype": args.dtype,
                       "retrieval_budget": budget,
                       "budget_fraction": budget / args.context_tokens},
            "quantities": {"middle": "mean sum_x min(p, q) per token, retrieval vs full cache",
                           "top": "TriForce accepted/proposed (vLLM spec-decode counters)"},
            "needle_found_by_reference": found,
            "table": table}
    report.write_json(out / "results.json", data)
    _write_md(out / "results.md", data)
    report.bar_plot(out / "acceptance.png", [LABELS[p] for p in args.policies], [],
                    "per-token acceptance, sum min(p, q)",
                    "retrieval-cache acceptance by selection policy",
                    groups={t: [row[p]["middle"] or 0.0 for p in args.policies]
                            for t, row in table.items()})
    return data


def _summarize(results: list[dict]) -> dict:
    reference = results[0]["tokens"]
    row = {"reference": {"tokens": reference}}
    for r in results[1:]:
        # vLLM's own counters of the full-cache verification (the drafter's top_* counters
        # also count prompt tokens of chunked/prefix-cached prefills; see RESULTS.md).
        spec = r["vllm_spec"]
        drafted = spec.get("vllm:spec_decode_num_draft_tokens") or 0
        accepted = spec.get("vllm:spec_decode_num_accepted_tokens") or 0
        tri = r["triforce"]
        row[r["name"].split("-", 1)[1]] = {
            "middle": tri["middle_pq_sum"] / tri["middle_pq_count"]
            if tri.get("middle_pq_count") else None,
            "middle_positions": tri.get("middle_pq_count", 0),
            "acceptance": accepted / drafted if drafted else None, "accepted": accepted,
            "proposed": drafted, "counters": tri, "identical": r["tokens"] == reference}
    return row


def _decode(model: str, tokens: list[int]) -> str:
    return bench_prompts.tokenizer(model).decode(tokens)


def _write_md(path: Path, data: dict) -> None:
    c = data["config"]
    policies = [p for p in POLICIES if p in next(iter(data["table"].values()))]
    header = ["task"] + [LABELS[p] for p in policies]
    sampled = c["temperature"] > 0
    rows = [[task] + [_fmt(row[p], check=not sampled) for p in policies]
            for task, row in data["table"].items()]
    intro = (f"Target `{Path(c['model']).name}` ({c['dtype']}), {c['batch']} prompt(s) of "
             f"{c['context_tokens']} tokens per task, {c['max_tokens']} new tokens, "
             f"temperature {c['temperature']}, top-p {c['top_p']}, gamma={c['gamma']}; "
             f"retrieval budget {c['retrieval_budget']} tokens "
             f"({100 * c['budget_fraction']:.1f}% of the context).\n\n"
             "**Cell = `A / B`**: A = the middle level's per-token acceptance, the mean of "
             "Σ min(p, q) (p: target over its full cache, q: over its retrieval cache) at the "
             "first middle position of each step; B = TriForce's accepted / proposed ratio "
             "(two-level TriForce; vLLM's counters of the full-cache verification of whole "
             "gamma-token drafts). "
             + ("" if sampled else "`*` marks a run whose greedy output differs from the "
                "full-cache reference. ")
             + "Needle passphrase in the (greedy) reference output: "
             f"{data['needle_found_by_reference']}.")
    report.write_markdown(path, "bench acceptance", [intro, report.markdown_table(header, rows)])


def _fmt(cell: dict, check: bool) -> str:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    text = f"{pct(cell['middle'])} / {pct(cell['acceptance'])}"
    return text + ("" if cell["identical"] or not check else " *")
