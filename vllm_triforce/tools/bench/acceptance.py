"""`vllm-triforce bench acceptance`: the paper's Table 1, teacher-forced on real text.

For every row (task) and column (selection policy), the mean over measured positions of
the per-token acceptance sum_x min(p(x), q(x)) -- p the target over its full cache, q the
target over the policy's retrieval cache, at the same position and prefix of the real
text (teacher forcing, `teacher.py`) -- at the paper's temperature 0.6 / top-p 0.9, with
a 95% interval (mean +- 1.96 standard errors over positions), and the greedy agreement
argmax p == argmax q. Paired differences against StreamingLLM and against the
per-position Top-K oracle come with their own intervals (same positions, so they separate
policies that overlapping marginal intervals do not).

Rows: `moby` (Moby-Dick, documents at evenly spread offsets), `text` (--text FILE, the
same way), `needle` (--needle: SOTU speeches with a 6-digit passphrase at 40% depth and
the question at the end; the measured positions are the answer " NNNNNN." -- its digits
are where retrieval matters). Budget = --budget-fraction of the context, rounded to whole
blocks, at least the engine's minimum (sinks + recent + tail + one selected block).
--budgets adds a budget sweep of the long-prose rows (budget_sweep.png).

    vllm-triforce bench acceptance --out DIR [--model NAME] [--text FILE] [--needle]
        [--context-tokens N] [--positions N] [--budget-fraction F] [--budgets B ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

from vllm_triforce.config import COMPACT_BANDS, BlockCounts, TriForceConfig
from vllm_triforce.tools.bench import prompts as bench_prompts
from vllm_triforce.tools.bench import report

# torch and the engine are imported where the bench runs, not here: `vllm-triforce`
# builds this module's parser for every command, `data fetch` included

BLOCK = 32
# Positions between a column's full selections. The engine re-selects at every drafting step
# (refresh_interval 1) from the newest committed token's query, and one step's drafts span at
# most num_speculative_tokens positions; between its middle rounds it re-selects with the
# newest middle token's query (MIDDLE: re-ranking its `middle_shortlist` if the policy can;
# MIDDLE_ALL: every candidate). STEP is the longest run of middle selections.
STEP = TriForceConfig().num_speculative_tokens
SHORTLIST = TriForceConfig().middle_shortlist
PER_POSITION, ONCE_PER_SPAN, MIDDLE, MIDDLE_ALL = 1, 0, "shortlist", "all"
# column -> (policy, constructor kwargs, positions between full selections, re-select between
# them with the column's own queries, label). A bare policy name is the policy as the engine
# builds and refreshes it (`make_policy(name)`); suffixes are variants. `retrieval` is
# TriForce's mean-key score; the engine's default is `default_column()` (`retrieval_var`,
# mean key + key variance, since key_variance became the default).
COLUMNS = {
    "topk_oracle_per_position": ("topk_oracle", {}, PER_POSITION, False,
                                 "Top-K oracle, per position"),
    "topk_oracle": ("topk_oracle", {}, STEP, MIDDLE, "Top-K, at refresh"),
    "streamingllm": ("streamingllm", {}, STEP, MIDDLE, "StreamingLLM"),
    "h2o": ("h2o", {}, STEP, MIDDLE, "H2O"),
    "retrieval": ("retrieval", {"variance": False}, STEP, MIDDLE, "Retrieval (mean key, sum)"),
    "retrieval_max": ("retrieval", {"aggregation": "max"}, STEP, MIDDLE,
                      "Retrieval (mean key, max)"),
    "retrieval_softmax": ("retrieval", {"aggregation": "softmax"}, STEP, MIDDLE,
                          "Retrieval (mean key, softmax)"),
    "retrieval_var": ("retrieval", {"variance": True}, STEP, MIDDLE,
                      "Retrieval (mean key + variance, sum)"),
    "retrieval_var_softmax": ("retrieval", {"variance": True, "aggregation": "softmax"}, STEP,
                              MIDDLE, "Retrieval (mean key + variance, softmax)"),
    "retrieval_var_compact": ("retrieval", {"variance": True}, STEP, MIDDLE,
                              "Retrieval (mean key + variance per band in bf16, profiled, sum)"),
    "retrieval_var_compact_flat": ("retrieval", {"variance": True}, STEP, MIDDLE,
                                   "Retrieval (mean key + variance per band in bf16, sum)"),
    "retrieval_var_compact16": ("retrieval", {"variance": True}, STEP, MIDDLE,
                                "Retrieval (mean key + variance per 16 bands in bf16, profiled, "
                                "sum)"),
    "retrieval_var_compact_fp32": ("retrieval", {"variance": True}, STEP, MIDDLE,
                                   "Retrieval (mean key + variance per band in float32, "
                                   "profiled, sum)"),
    "retrieval_var_bf16": ("retrieval", {"variance": True}, STEP, MIDDLE,
                           "Retrieval (mean key + variance per channel in bf16, sum)"),
    "retrieval_var_fp8": ("retrieval", {"variance": True}, STEP, MIDDLE,
                          "Retrieval (mean key + variance per channel, both in fp8 scaled per "
                          "block and head, sum)"),
    "retrieval_var_fp8_mean": ("retrieval", {"variance": True}, STEP, MIDDLE,
                               "Retrieval (mean key in fp8 scaled per block and head + "
                               "variance, sum)"),
    "retrieval_var_fp8_var": ("retrieval", {"variance": True}, STEP, MIDDLE,
                              "Retrieval (mean key + variance per channel in fp8 scaled per "
                              "block and head, sum)"),
    "retrieval_var_fp8_log": ("retrieval", {"variance": True}, STEP, MIDDLE,
                              "Retrieval (mean key in fp8 + variance per channel in an 8-bit "
                              "log code, both scaled per block and head, sum)"),
    "quest": ("quest", {}, STEP, MIDDLE, "Quest (min/max, softmax)"),
    "quest_max": ("quest", {"aggregation": "max"}, STEP, MIDDLE, "Quest (min/max, max)"),
    "quest_sum": ("quest", {"aggregation": "sum"}, STEP, MIDDLE, "Quest (min/max, sum)"),
    "rerank": ("rerank", {}, STEP, MIDDLE, "Retrieval, exact re-rank of a 4x shortlist"),
    "rerank_8x": ("rerank", {"factor": 8}, STEP, MIDDLE,
                  "Retrieval, exact re-rank of an 8x shortlist"),
    "retrieval_per_position": ("retrieval", {}, PER_POSITION, False,
                               "Retrieval, per position (exact queries)"),
    "retrieval_all_candidates": ("retrieval", {}, STEP, MIDDLE_ALL,
                                 "Retrieval, every candidate re-scored between rounds"),
    "retrieval_every_step": ("retrieval", {}, STEP, False,
                             "Retrieval, at step starts only"),
    "retrieval_once_per_span": ("retrieval", {}, ONCE_PER_SPAN, False,
                                "Retrieval, once per span (refresh_interval 64)"),
}
# the summaries each kind of engine store keeps, as a COMPACT_COLUMNS entry (None: float)
CODED_COLUMN = (False, None, "log8", "float8_e4m3fn")  # `compact_summaries`
BANDED_COLUMN = (True, COMPACT_BANDS, "bfloat16", None)  # `compact_key_variance`
# columns that score the key variance per band of channels (`compact_key_variance`) or
# rounded, and the mean key rounded (teacher.py `TeacherForcedEngine.compact_summaries`):
# (with the channel profile, bands or None: per channel, the variance's element, the mean's)
COMPACT_COLUMNS = {"retrieval_var_compact": BANDED_COLUMN,
                   "retrieval_var_compact_flat": (False, COMPACT_BANDS, "bfloat16", None),
                   "retrieval_var_compact16": (True, 16, "bfloat16", None),
                   "retrieval_var_compact_fp32": (True, COMPACT_BANDS, "float32", None),
                   "retrieval_var_bf16": (False, None, "bfloat16", None),
                   "retrieval_var_fp8": (False, None, "float8_e4m3fn", "float8_e4m3fn"),
                   "retrieval_var_fp8_mean": (False, None, None, "float8_e4m3fn"),
                   "retrieval_var_fp8_var": (False, None, "float8_e4m3fn", None),
                   "retrieval_var_fp8_log": CODED_COLUMN}
# paired differences: against the per-position oracle, StreamingLLM, mean-key retrieval and
# the engine's default (`default_column`)
ORACLE, BASELINE, MEAN_KEY = "topk_oracle_per_position", "streamingllm", "retrieval"
SWEEP_PLOT = (ORACLE, "topk_oracle", "h2o", "quest", "retrieval", "retrieval_var", "rerank",
              BASELINE)  # the rest: table
QUICK = dict(context_tokens=512, positions=32, needle_documents=4, warmup=4)
Z95 = 1.96


def default_column() -> str:
    """The column that selects as the engine does with its default config on a GPU (its
    summaries coded: `retrieval_var_fp8_log`; a CPU's are float, `retrieval_var`)."""
    cfg = TriForceConfig()
    kinds = cfg.summary_kinds()
    stored = (CODED_COLUMN if kinds.coded and kinds.keep_variance
              else BANDED_COLUMN if kinds.compact_variance else None)
    return next(name for name, (policy, kwargs, every, middle, _) in COLUMNS.items()
                if (policy, kwargs, every, middle, COMPACT_COLUMNS.get(name))
                == (cfg.selection_policy, cfg.policy_kwargs(), STEP, MIDDLE, stored))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", type=Path, default=None,
                   help="also measure this UTF-8 (else Latin-1) text file (row `text`)")
    p.add_argument("--needle", action="store_true",
                   help="also measure the SOTU needle task (row `needle`)")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--positions", type=int, default=256,
                   help="measured positions per cell of a prose row (spans of --span "
                        "positions, one span per document, at least 4 documents)")
    p.add_argument("--span", type=int, default=64,
                   help="positions per document; the `_once_per_span` columns keep the "
                        "selection made at its first position for all of them")
    p.add_argument("--needle-documents", type=int, default=16,
                   help="needle documents (8 measured positions each)")
    p.add_argument("--needle-seed", type=int, default=0,
                   help="another seed: other passphrases and speeches (a fresh sample)")
    p.add_argument("--budget-fraction", type=float, default=0.03)
    p.add_argument("--budgets", type=int, nargs="*", default=[],
                   help="budget sweep (tokens) of the prose rows, beside the main budget")
    p.add_argument("--policies", nargs="+", default=list(COLUMNS), choices=list(COLUMNS),
                   help="columns")
    p.add_argument("--warmup", type=int, default=16,
                   help="full-cache positions before each span (H2O's query history)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--kv-cache-gib", type=int, default=None,
                   help="VLLM_CPU_KVCACHE_SPACE of the engine (default: the environment's, else 4)")


def budget_blocks(context: int, fraction: float, min_blocks: int) -> int:
    """Whole blocks nearest to fraction * context, at least min_blocks."""
    return max(round(context * fraction / BLOCK), min_blocks)


def run_acceptance(args, model: str, out: Path) -> dict:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    from vllm_triforce.tools.bench.teacher import TeacherForcedEngine, measure_span

    start = time.perf_counter()
    tasks = _tasks(args, model)
    longest = max(len(doc) for docs, _, _ in tasks.values() for doc in docs)
    # room past the documents: requests prefilled early decode while later ones prefill, and
    # one reaching max_model_len would finish and free its blocks before the measurement
    engine = TeacherForcedEngine(model, args.dtype, max_model_len=longest + 32 * BLOCK,
                                 max_num_seqs=max(len(docs) for docs, _, _ in tasks.values()),
                                 kv_cache_gib=args.kv_cache_gib, block_size=BLOCK)
    try:
        g = engine.blocks
        # sinks + recent + the growing tail + one retrieved block
        min_blocks = g.retrieval_sink_blocks + g.retrieval_recent_blocks + 2
        main = budget_blocks(args.context_tokens, args.budget_fraction, min_blocks)
        sweep = sorted({max(b // BLOCK, min_blocks) for b in args.budgets} - {main})
        cells, sweep_cells = [], []
        for task, (docs, context, span) in tasks.items():
            budgets = [main] + (sweep if task != "needle" else [])
            columns = [_column(name, dataclasses.replace(g, budget_blocks=b), engine.summaries)
                       for b in budgets for name in args.policies]
            t0 = time.perf_counter()
            result = measure_span(engine, docs, context, span, columns, args.warmup,
                                  args.temperature, args.top_p, _progress(task, t0))
            print(f"bench acceptance: {task}: {len(docs)} documents x {span} positions, "
                  f"{len(columns)} columns, {time.perf_counter() - t0:.0f} s", flush=True)
            for b in budgets:
                rows = _cells(task, result, args.policies, b)
                (cells if b == main else sweep_cells).extend(rows)
    finally:
        engine.close()
    wall = time.perf_counter() - start
    data = {"default_policy": default_column(),
            "config": {"model": model, "dtype": args.dtype, "context_tokens": args.context_tokens,
                       "budget_tokens": main * BLOCK, "budget_fraction": args.budget_fraction,
                       "block_size": BLOCK, "sink_blocks": g.retrieval_sink_blocks,
                       "recent_blocks": g.retrieval_recent_blocks, "span": args.span, "step_positions": STEP,
                       "warmup": args.warmup, "temperature": args.temperature,
                       **({"needle_documents": args.needle_documents,
                           "needle_seed": args.needle_seed} if args.needle else {}),
                       "top_p": args.top_p, "interval": "mean +- 1.96 SE over positions",
                       "wall_seconds": round(wall, 1)},
            "cells": cells, "sweep": sweep_cells}
    report.write_json(out / "results.json", data)
    _write_md(out / "results.md", data)
    _plots(out, data)
    print(f"bench acceptance: wall time {wall:.0f} s", flush=True)
    return data


def _progress(task: str, start: float):
    def show(done: int, total: int) -> None:
        if done % 16 == 0 or done == total:
            print(f"bench acceptance: {task}: {done}/{total} positions, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return show


def _column(name: str, blocks: BlockCounts, keys) -> Column:
    """Column `name` of COLUMNS at the budget of `blocks`; `keys`: the exact keys a
    two-stage policy reads (the teacher's key copy)."""
    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import Selector
    from vllm_triforce.tools.bench.teacher import Column

    policy, kwargs, refresh_every, middle, _ = COLUMNS[name]
    policy = make_policy(policy, **kwargs)
    shortlist = SHORTLIST if middle == MIDDLE else 0  # the Selector ignores it if it cannot
    return Column(f"{name}@{blocks.budget_blocks}", Selector(policy, blocks, shortlist, keys),
                  refresh_every, bool(middle), compact_variance=COMPACT_COLUMNS.get(name))


# ---- rows ------------------------------------------------------------------------------
def _tasks(args, model: str) -> dict[str, tuple[list[list[int]], int, int]]:
    """task -> (documents, context tokens, measured positions per document)."""
    num_docs = max(4, math.ceil(args.positions / args.span))
    span = args.positions // num_docs
    length = args.context_tokens + span
    tasks = {"moby": (bench_prompts.book_prompts(model, length, num_docs),
                      args.context_tokens, span)}
    if args.text is not None:
        ids = bench_prompts.tokenizer(model)(_read_text(args.text))["input_ids"]
        tasks["text"] = (_spread(ids, length, num_docs, args.text), args.context_tokens, span)
    if args.needle:
        tasks["needle"] = _needle_task(model, args.context_tokens, args.needle_documents,
                                        args.needle_seed)
    return tasks


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _spread(ids: list[int], length: int, num_docs: int, source) -> list[list[int]]:
    """num_docs windows of `length` tokens at evenly spread offsets."""
    if len(ids) < length:
        from vllm_triforce.tools.bench.runner import BenchError

        raise BenchError(f"{source} has {len(ids)} tokens; a document needs {length}")
    stride = (len(ids) - length) // max(num_docs - 1, 1)
    return [ids[i * stride: i * stride + length] for i in range(num_docs)]


def _needle_task(model: str, context: int, num_docs: int, seed: int = 0):
    """Documents = needle prompt (context tokens, ends with the question) + the answer;
    the measured positions are the answer's tokens."""
    tok = bench_prompts.tokenizer(model)
    needles = bench_prompts.needle_prompts(model, context, num_docs, seed)
    answers = [tok(f" {n['passphrase']}.", add_special_tokens=False)["input_ids"]
               for n in needles]
    span = min(map(len, answers))
    return [n["ids"] + a[:span] for n, a in zip(needles, answers)], context, span


# ---- statistics --------------------------------------------------------------------------
def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): mean +- 1.96 standard errors."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def _cells(task: str, result, names: list[str], budget: int) -> list[dict]:
    acc = {n: result.acceptance[f"{n}@{budget}"] for n in names}
    cells = []
    for name in names:
        mean, lo, hi = mean_ci(acc[name])
        agree = [float(a) for a in result.agreement[f"{name}@{budget}"]]
        cell = {"task": task, "policy": name, "acceptance": mean, "ci95": [lo, hi],
                "positions": len(acc[name]), "greedy_agreement": mean_ci(agree)[0],
                "greedy_ci95": list(mean_ci(agree)[1:]), "budget_tokens": budget * BLOCK}
        for ref, key in ((BASELINE, "minus_streamingllm"), (ORACLE, "minus_oracle"),
                         (MEAN_KEY, "minus_retrieval"), (default_column(), "minus_default")):
            if ref in acc and ref != name:
                diff = mean_ci([a - b for a, b in zip(acc[name], acc[ref])])
                cell[key] = {"mean": diff[0], "ci95": list(diff[1:])}
        cells.append(cell)
    return cells


# ---- report ------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _interval(lo: float, hi: float) -> str:
    return f"[{_pct(lo)}, {_pct(hi)}]"


def _diff(cell: dict, key: str) -> str:
    d = cell.get(key)
    return "" if d is None else f"{100 * d['mean']:+.1f} {_interval(*d['ci95'])}"


def _table(cells: list[dict]) -> str:
    header = ["policy", "acceptance % [95% CI]", "− StreamingLLM, points", "− oracle, points",
              "− Retrieval, points", "− engine default, points", "greedy agreement %",
              "positions"]
    rows = [[COLUMNS[c["policy"]][-1] + f" (`{c['policy']}`)",
             f"{_pct(c['acceptance'])} {_interval(*c['ci95'])}", _diff(c, "minus_streamingllm"),
             _diff(c, "minus_oracle"), _diff(c, "minus_retrieval"), _diff(c, "minus_default"),
             _pct(c["greedy_agreement"]), c["positions"]]
            for c in cells]
    return report.markdown_table(header, rows)


def _write_md(path: Path, data: dict) -> None:
    c = data["config"]
    intro = (f"Target `{Path(c['model']).name}` ({c['dtype']}), context {c['context_tokens']} "
             f"tokens, retrieval budget {c['budget_tokens']} tokens ({c['sink_blocks']} sink + "
             f"{c['recent_blocks']} recent blocks + the growing tail block + selected blocks of "
             f"{c['block_size']}), temperature {c['temperature']}, top-p {c['top_p']}. "
             "Teacher-forced: at every measured position of the real text, p = the target over "
             "its full cache, q = over the policy's retrieval cache; acceptance = mean "
             "Σ min(p, q); "
             f"intervals: {c['interval']} (positions of one document are correlated, so these "
             "are somewhat optimistic). As in the engine, a selection is made from the newest "
             f"committed token's query every {c['step_positions']} positions (a step drafts at "
             "most that many) and, in between, from the query the column's own pass computed "
             "at the previous position (the engine's middle rounds); variants: exact queries "
             "at every position (`_per_position`), at step starts only (`_every_step`), once "
             f"per span of {c['span']} positions (`_once_per_span`). "
             f"Engine default policy: `{data['default_policy']}`. Wall time "
             f"{c['wall_seconds']:.0f} s.")
    if "needle_documents" in c:
        intro += (f" Needle: {c['needle_documents']} documents"
                  + (f", seed {c['needle_seed']}." if c["needle_seed"] else "."))
    sections = [intro]
    for task in dict.fromkeys(cell["task"] for cell in data["cells"]):
        sections.append(f"## {task}\n\n" + _table([x for x in data["cells"] if x["task"] == task]))
    if data["sweep"]:
        sections.append("## budget sweep\n\n" + _sweep_table(data))
    report.write_markdown(path, "bench acceptance (teacher-forced)", sections)


def _sweep_table(data: dict) -> str:
    cells = [c for c in data["cells"] if c["task"] != "needle"] + data["sweep"]
    budgets = sorted({c["budget_tokens"] for c in cells})
    rows = []
    for task in dict.fromkeys(c["task"] for c in cells):
        for policy in dict.fromkeys(c["policy"] for c in cells):
            by_budget = {c["budget_tokens"]: c for c in cells
                         if c["task"] == task and c["policy"] == policy}
            rows.append([task, COLUMNS[policy][-1]] + [
                f"{_pct(by_budget[b]['acceptance'])} {_interval(*by_budget[b]['ci95'])}"
                if b in by_budget else "" for b in budgets])
    return report.markdown_table(["task", "policy"] + [f"{b} tokens" for b in budgets], rows)


def _plots(out: Path, data: dict) -> None:
    tasks = list(dict.fromkeys(c["task"] for c in data["cells"]))
    policies = list(dict.fromkeys(c["policy"] for c in data["cells"]))
    value = {(c["task"], c["policy"]): c["acceptance"] for c in data["cells"]}
    report.bar_plot(out / "acceptance.png", [COLUMNS[p][-1] for p in policies], [],
                    "acceptance, mean Σ min(p, q)", "teacher-forced acceptance by policy",
                    groups={t: [value[(t, p)] for p in policies] for t in tasks})
    if not data["sweep"]:
        return
    cells = [c for c in data["cells"] + data["sweep"] if c["task"] == "moby"]
    budgets = sorted({c["budget_tokens"] for c in cells})
    shown = [p for p in SWEEP_PLOT if p in policies]
    series = {COLUMNS[p][-1]: [next(c["acceptance"] for c in cells if c["policy"] == p
                                   and c["budget_tokens"] == b) for b in budgets]
              for p in shown}
    report.line_plot(out / "budget_sweep.png", budgets, series, "retrieval budget (tokens)",
                     "acceptance, mean Σ min(p, q)", "Moby-Dick: acceptance vs budget")
