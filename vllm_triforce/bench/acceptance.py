"""`vllm-triforce bench acceptance`: the paper's Table 1 on our data.

Rows: Moby-Dick passages and a needle-in-a-haystack task from the SOTU speeches (a
6-digit passphrase at 40% depth, the prompt ends asking for it). Columns: the four
selection policies of the retrieval cache (Top-K oracle, StreamingLLM, H2O, Retrieval),
retrieval budget ≈ 3% of the context (rounded to whole blocks, at least the minimum
the config allows). Reference: the target over its full cache (plain vLLM run).

Quantity: two-level TriForce (the target over its retrieval cache drafts gamma tokens
for the target over its full cache), greedy; the cell is accepted / proposed tokens of
that full-cache verification (vLLM's `spec_decode_num_accepted_tokens / num_draft_tokens`
over the timed generation).
Not measured: the per-token Σ min(p, q) of the middle level (it would need both
distributions per position; the counters only see accept/reject).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_triforce.bench import prompts as bench_prompts
from vllm_triforce.bench import report
from vllm_triforce.bench.runner import run_methods

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
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                   help="columns (selection policies)")


def budget_for(context: int, fraction: float) -> int:
    return max(round(context * fraction / BLOCK) * BLOCK, MIN_BUDGET)


def run_acceptance(args, model: str, out: Path) -> dict:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    budget = budget_for(args.context_tokens, args.budget_fraction)
    needles = bench_prompts.needle_prompts(model, args.context_tokens, args.batch)
    tasks = {"Moby-Dick": bench_prompts.book_prompts(model, args.context_tokens, args.batch),
             "SOTU needle": [n["ids"] for n in needles]}
    runs = [{"name": "reference", "spec": None}] + [
        {"name": p, "spec": {"method": "triforce", "num_speculative_tokens": args.gamma,
                             "retrieval_budget": budget, "selection_policy": p}}
        for p in args.policies]
    all_runs = [{**run, "name": f"{slug}-{run['name']}", "prompts": ids}
                for slug, ids in zip(("moby", "needle"), tasks.values()) for run in runs]
    job = {"model": model, "prompts": [], "max_tokens": args.max_tokens, "repeats": 1,
           "temperature": 0.0,
           "max_model_len": args.context_tokens + args.max_tokens + 2 * args.gamma + 64}
    # --quick: one child process for all runs (start-up dominates tiny runs).
    results = run_methods(job, all_runs, out, isolate=not args.quick, desc="bench acceptance")
    table = {task: _summarize(results[i * len(runs):(i + 1) * len(runs)])
             for i, task in enumerate(tasks)}
    found = [n["passphrase"] in _decode(model, toks) for n, toks in
             zip(needles, table["SOTU needle"]["reference"]["tokens"])]
    data = {"config": {"model": model, "context_tokens": args.context_tokens,
                       "batch": args.batch, "max_tokens": args.max_tokens, "gamma": args.gamma,
                       "retrieval_budget": budget,
                       "budget_fraction": budget / args.context_tokens},
            "quantity": "top-level accepted/proposed (two-level TriForce, greedy)",
            "middle_sum_min_pq": "not measured", "needle_found_by_reference": found,
            "table": table}
    report.write_json(out / "results.json", data)
    _write_md(out / "results.md", data)
    report.bar_plot(out / "acceptance.png", [LABELS[p] for p in args.policies], [],
                    "accepted / proposed", "full-cache acceptance by selection policy",
                    groups={t: [row[p]["acceptance"] or 0.0 for p in args.policies]
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
        row[r["name"].split("-", 1)[1]] = {
            "acceptance": accepted / drafted if drafted else None, "accepted": accepted,
            "proposed": drafted, "counters": r["triforce"], "identical": r["tokens"] == reference}
    return row


def _decode(model: str, tokens: list[int]) -> str:
    return bench_prompts.tokenizer(model).decode(tokens)


def _write_md(path: Path, data: dict) -> None:
    c = data["config"]
    policies = [p for p in POLICIES if p in next(iter(data["table"].values()))]
    header = ["task"] + [LABELS[p] for p in policies]
    rows = [[task] + [_fmt(row[p]) for p in policies] for task, row in data["table"].items()]
    intro = (f"Target `{Path(c['model']).name}`, {c['batch']} prompt(s) of {c['context_tokens']} "
             f"tokens per task, {c['max_tokens']} new tokens, greedy, gamma={c['gamma']}; "
             f"retrieval budget {c['retrieval_budget']} tokens "
             f"({100 * c['budget_fraction']:.1f}% of the context).\n\n"
             "**Cell = TriForce's accepted / proposed ratio at the top level** (two-level "
             "TriForce: the target over its retrieval cache drafts, the target over its full "
             "cache verifies). The middle level's per-token Σ min(p, q) is **not measured**. "
             "`*` marks a run whose greedy output differs from the full-cache reference. "
             f"Needle passphrase in the reference output: {data['needle_found_by_reference']}.")
    report.write_markdown(path, "bench acceptance", [intro, report.markdown_table(header, rows)])


def _fmt(cell: dict) -> str:
    acc = cell["acceptance"]
    text = "n/a" if acc is None else f"{100 * acc:.1f}%"
    return text + ("" if cell["identical"] else " *")
