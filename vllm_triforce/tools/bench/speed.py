"""`vllm-triforce bench speed`: every vLLM decoding method against TriForce, same prompts.

Methods: plain vLLM, vLLM `draft_model` (with --draft), vLLM `ngram`, TriForce two-level,
TriForce three-level (with --draft). Greedy; Moby-Dick slices of --prompt-tokens tokens,
--batch requests, --max-tokens new tokens. Prefill is timed on its own (1 new token),
then the timed generations hit the prefix cache; decode tok/s and per-token latency are
medians over --repeats. Every method's greedy tokens are compared with plain vLLM's.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vllm_triforce.config import FULL_KEY_POLICIES, POLICIES
from vllm_triforce.tools.bench import prompts as bench_prompts
from vllm_triforce.tools.bench import report
from vllm_triforce.tools.bench.runner import run_interleaved, run_methods
from vllm_triforce.tools.bench.worker import merge_times

# The settings TriForce's engine runs under where the user left vLLM's default
# (engine_settings.decide) that a plain CPU engine can take as `LLM` keywords. On a CPU
# vLLM turns async scheduling off itself (vllm/platforms/cpu.py, 0.32.0), so there
# `plain_forced` runs plain vLLM's own settings: it measures the host's spread.
FORCED_SETTINGS = {"async_scheduling": False}

QUICK = dict(prompt_tokens=256, batch=2, max_tokens=8, repeats=1, budget=192)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every method's process this many times, alternating methods: "
                        "separate processes of one configuration differ by 7-30%% on 2-vCPU "
                        "hosts, and the host drifts over a run; the report gives each "
                        "round's speedup and the median")
    p.add_argument("--interleave", action="store_true",
                   help="with --rounds: every method's engine lives at once, in a process of "
                        "its own, and each round times every row once, the processes taking "
                        "turns (ABBA over rounds): a round's rows are a few turns apart, not "
                        "whole processes' runs, so the host's drift falls on all alike (needs "
                        "the memory of every engine at once)")
    p.add_argument("--budget", type=int, default=512, help="TriForce retrieval_budget")
    p.add_argument("--gamma", type=int, nargs="+", default=[6],
                   help="num_speculative_tokens: TriForce runs with the depth controller up to "
                        "the largest, then the same engine is timed at each fixed depth given "
                        "(e.g. --gamma 1 2 3 4 6: the controller against every fixed k)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="subset of: plain draft_model ngram triforce2 triforce3 plain_forced "
                        "(plain_forced: plain vLLM under the settings TriForce forces, "
                        "async scheduling off, which a CPU engine already is; only when "
                        "named)")
    p.add_argument("--policies", nargs="+", default=None, choices=POLICIES,
                   help="also time TriForce with each of these selection policies (rows "
                        "`triforce2 <policy>` and its fixed depths, likewise triforce3; the "
                        "unsuffixed rows use the default policy)")


def method_runs(args, draft: str | None) -> list[dict]:
    k = max(args.gamma)
    tri = {"method": "triforce", "num_speculative_tokens": k, "retrieval_budget": args.budget}
    # The plain run also measures the isolated per-step costs of the cost model.
    runs = [{"name": "plain", "spec": None,
             "calibrate": {"query_tokens": sorted({g + 1 for g in args.gamma}),
                           "contexts": [args.budget]}}]
    if args.methods and "plain_forced" in args.methods:
        # what TriForce's settings alone cost a plain step (engine_settings.decide)
        runs.append({"name": "plain_forced", "spec": None, "engine": FORCED_SETTINGS})
    if draft:
        runs.append({"name": "draft_model", "spec": {"method": "draft_model", "model": draft,
                                                     "num_speculative_tokens": k}})
    levels = [("triforce2", tri)] + ([("triforce3", {**tri, "model": draft})] if draft else [])
    for name, spec in levels:
        runs.append(_with_fixed_depths(name, spec, args.gamma))
        for policy in args.policies or ():
            runs.append(_with_fixed_depths(f"{name} {policy}",
                                           {**spec, "selection_policy": policy,
                                            "allow_full_key_copy": policy in FULL_KEY_POLICIES},
                                           args.gamma))
    # Last: after an ngram engine a process cannot build another one (bench/worker.py).
    runs.append({"name": "ngram", "spec": {"method": "ngram", "num_speculative_tokens": k,
                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}})
    if args.methods:
        runs = [r for r in runs if r["name"].split()[0] in args.methods]
    return runs


def _with_fixed_depths(name: str, spec: dict, gammas: list[int]) -> dict:
    """TriForce with its depth controller (`name`), then the same engine at each fixed depth
    (`name k=G`: every request drafts G tokens every step, as fixed-gamma TriForce does),
    always including k=0: the engine drafting nothing, whose ratio to plain is what
    TriForce costs a step in which it does not draft."""
    return {"name": name, "spec": spec,
            "variants": [{"name": f"{name} k={g}", "forced": [g]}
                         for g in sorted({0, *gammas})]}


def run_speed(args, model: str, draft: str | None, out: Path) -> dict:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    ids = bench_prompts.book_prompts(model, args.prompt_tokens, args.batch)
    job = {"model": model, "prompts": ids, "max_tokens": args.max_tokens,
           "repeats": args.repeats, "dtype": args.dtype, "temperature": 0.0,
           "max_model_len": args.prompt_tokens + args.max_tokens + 2 * max(args.gamma) + 64}
    if args.interleave:
        results = run_interleaved(job, method_runs(args, draft), out, args.rounds,
                                  desc="bench speed")
        rounds = [results]
    else:
        rounds = [run_methods(job, method_runs(args, draft),
                              out if args.rounds == 1 else out / f"round{i + 1}",
                              isolate=not args.quick, desc=f"bench speed, round {i + 1}")
                  for i in range(args.rounds)]
        results = merge_rounds(rounds)
    rows = summarize(results, args.batch, args.max_tokens)
    data = {"config": {k: getattr(args, k) for k in
                       ("prompt_tokens", "batch", "max_tokens", "repeats", "rounds",
                        "interleave", "budget",
                        "gamma", "policies", "dtype")}
            | {"model": model, "draft": draft,
               "openmp": _openmp([r for runs in rounds for r in runs])}, "rows": rows,
            "all_identical": all(r["identical"] for r in rows), "raw": results}
    report.write_json(out / "results.json", data)
    _write_md(out / "results.md", data)
    report.bar_plot(out / "speed.png", [r["method"] for r in rows],
                    [r["decode_tok_s"] for r in rows], "decode tokens/s (median)",
                    f"{Path(model).name}: {args.batch} x {args.prompt_tokens} tokens, "
                    f"{args.max_tokens} new")
    return data


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One result per run: the first round's, with every round's decode times (`decode_s`,
    all repeats of all rounds) and each round's median kept as `round_decode_s`. Every
    round's greedy tokens must equal the first's (else the run is marked by tokens = None)."""
    return [{**runs[0], **merge_times(runs)} for runs in zip(*rounds)]


def summarize(results: list[dict], batch: int, max_tokens: int) -> list[dict]:
    reference = results[0]["tokens"]
    rows = []
    for r in results:
        decode = statistics.median(r["decode_s"])
        tri = r.get("triforce") or {}
        spec = r.get("vllm_spec") or {}
        drafted = spec.get("vllm:spec_decode_num_draft_tokens")
        accepted = spec.get("vllm:spec_decode_num_accepted_tokens")
        rows.append({
            "method": r["name"], "prefill_s": r["prefill_s"], "decode_s": decode,
            "decode_tok_s": batch * max_tokens / decode,
            "ms_per_token": 1000 * decode / max_tokens,
            "top_acceptance": (accepted / drafted) if drafted else None,
            "middle_acceptance": (tri["middle_accepted"] / tri["middle_proposed"])
            if tri.get("middle_proposed") else None,
            "identical": r["tokens"] is not None and r["tokens"] == reference,
            "controller": _controller_summary(tri) if tri and not r.get("forced") else None,
            "host_ms_per_round": _host_ms_per_round(tri),
            "syncs": r.get("syncs")})
    base = rows[0]["decode_tok_s"]
    calibration = results[0].get("calibration")
    plain_rounds = results[0].get("round_decode_s", [])
    for row, r in zip(rows, results):
        row["speedup"] = row["decode_tok_s"] / base
        # round i: plain's decode time over this method's, both from round i's processes
        row["round_speedups"] = [p / t for p, t in zip(plain_rounds, r.get("round_decode_s", []))]
        row["cost_model"] = cost_model(r, batch, calibration)
        row["predicted_speedup"] = row["cost_model"] and row["cost_model"]["predicted_speedup"]
    return rows


def _host_ms_per_round(tri: dict) -> float | None:
    """TriForce's time in `propose` outside model forwards, per middle round: the host work
    a GPU cannot hide (engine/stats.py; forwards device-timed: VLLM_TRIFORCE_TIME_FORWARDS)."""
    if not tri.get("middle_rounds"):
        return None
    return 1000 * (tri["middle_seconds"] - tri.get("forward_seconds", 0.0)) / tri["middle_rounds"]


def _syncs_cell(syncs: dict | None) -> str | None:
    """"max/round, max/step (mean/round)" from worker._count_syncs, or None."""
    if not syncs:
        return None
    return (f"{syncs['max_round']}, {syncs['max_step']} "
            f"({syncs['mean_round']:.1f}/round)")


def _controller_summary(tri: dict) -> dict:
    """What the depth controller chose during the timed generations."""
    counts = tri.get("depth_counts") or []
    steps = tri.get("plain_steps", 0) + tri.get("drafting_steps", 0)
    return {"depth_counts": counts, "plain_steps": tri.get("plain_steps", 0), "steps": steps,
            "mean_depth": sum(k * n for k, n in enumerate(counts)) / max(sum(counts), 1),
            "predicted_tok_s": tri.get("predicted_tokens_per_s"),
            "achieved_tok_s": tri.get("achieved_tokens_per_s")}


def cost_model(result: dict, batch: int, calibration: dict | None) -> dict | None:
    """TriForce's speedup predicted from per-level step costs and measured acceptance:

        predicted = L * T1 / (R * Tm + Tv)

    L: tokens per full-cache step (1 + accepted / drafts, vLLM's mean acceptance length;
    measured, so clustered acceptance counts as it happened); R: middle-level rounds per
    step (measured); T1: a plain decode step over the full context; Tv: a full-context step
    with gamma2 + 1 query tokens per request (the verification); Tm: a middle round --
    two levels: a plain decode step over a context of `retrieval_budget` tokens. T1, Tv and
    two-level Tm are measured in isolation on plain vLLM (`worker.calibrate`); three-level
    Tm (small draft + retrieval pass) is the in-situ mean round time. achieved / predicted
    is then the efficiency of the implementation against those passes; the in-situ
    `middle_round_s` and `rest_of_step_s` show where the difference goes."""
    tri, spec = result.get("triforce"), result.get("vllm_spec") or {}
    drafts = spec.get("vllm:spec_decode_num_drafts")
    forced = result.get("forced")
    if not tri or not drafts or not tri.get("middle_rounds") or not calibration:
        return None
    if not forced or len(set(forced)) != 1:  # the controller: depths vary, no single Tv
        return None
    settings = result["spec"]
    gamma = forced[0]
    steps = drafts / batch
    decode_total = statistics.median(result["decode_s"]) * len(result["decode_s"])
    in_situ_round = tri["middle_seconds"] / tri["middle_rounds"]
    two_level = settings.get("model") is None
    out = {
        "L": 1 + spec["vllm:spec_decode_num_accepted_tokens"] / drafts,
        "R": tri["middle_rounds"] / steps,
        "T1": calibration["step_s"]["1"],
        "Tv": calibration["step_s"][str(gamma + 1)],
        "Tm": calibration["context_step_s"][str(settings["retrieval_budget"])] if two_level
        else in_situ_round,
        "Tm_source": "isolated" if two_level else "in situ",
        "middle_round_s": in_situ_round,
        "rest_of_step_s": (decode_total - tri["middle_seconds"]) / steps,
        # proposer time outside model forwards: the host work a GPU would wait on
        "host_ms_per_round": 1000 * (tri["middle_seconds"] - tri.get("forward_seconds", 0.0))
        / tri["middle_rounds"],
    }
    out["predicted_speedup"] = out["L"] * out["T1"] / (out["R"] * out["Tm"] + out["Tv"])
    return out


def _openmp(results: list[dict]) -> str | None:
    """The OpenMP runtime(s) the engine processes ran on (bench/runner.py preloads Intel's)."""
    return ", ".join(sorted({r["openmp"] for r in results if r.get("openmp")})) or None


def _round_kind(config: dict) -> str:
    if config.get("interleave"):
        return ("taken in turns by one live process per method (ABBA: the rows' order "
                "reversed every other round)")
    return "of one process per method"


def _write_md(path: Path, data: dict) -> None:
    c = data["config"]
    header = ["method", "prefill s", "decode tok/s", "ms / token (per request)",
              f"speedup vs {data['rows'][0]['method']}", "accepted/proposed (full-cache verify)",
              "middle accepted/proposed", "cost-model speedup", "host ms / round",
              "syncs: max / round, max / step", "greedy output = plain"]
    rows = [[r["method"], r["prefill_s"], r["decode_tok_s"], r["ms_per_token"],
             f"{r['speedup']:.2f}x", r["top_acceptance"], r["middle_acceptance"],
             None if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x",
             r.get("host_ms_per_round"), _syncs_cell(r.get("syncs")),
             "yes" if r["identical"] else "NO"] for r in data["rows"]]
    if c.get("rounds", 1) > 1:
        header.insert(5, "speedup per round")
        for row, r in zip(rows, data["rows"]):
            row.insert(5, " ".join(f"{x:.2f}" for x in r["round_speedups"]))
    intro = (f"Target `{Path(c['model']).name}`, draft `{c['draft'] and Path(c['draft']).name}`, "
             f"dtype {c['dtype']}; "
             f"{c['batch']} x {c['prompt_tokens']}-token Moby-Dick prompts, {c['max_tokens']} new "
             f"tokens, greedy; medians over {c['repeats']} repeat(s) in each of "
             f"{c.get('rounds', 1)} round(s) {_round_kind(c)}; gamma={c['gamma']}, "
             f"retrieval_budget={c['budget']}; OpenMP: {c.get('openmp') or 'not recorded'}. "
             f"Decode time excludes prefill (prefix-cache hit). "
             f"All greedy outputs identical: **{'yes' if data['all_identical'] else 'NO'}**.")
    cost_rows = [[r["method"], f"{c['L']:.2f}", f"{c['R']:.2f}", 1000 * c["T1"],
                  1000 * c["Tv"], f"{1000 * c['Tm']:.1f} ({c['Tm_source']})",
                  1000 * c["middle_round_s"], c["host_ms_per_round"],
                  1000 * c["rest_of_step_s"], f"{c['predicted_speedup']:.2f}x", f"{r['speedup']:.2f}x",
                  f"{r['speedup'] / c['predicted_speedup']:.0%}"]
                 for r in data["rows"] if (c := r.get("cost_model"))]
    parts = [intro, report.markdown_table(header, rows)]
    ctl_rows = [[r["method"], " ".join(f"{k}:{n}" for k, n in enumerate(c["depth_counts"]) if n),
                 f"{c['mean_depth']:.2f}", f"{c['plain_steps']}/{c['steps']}",
                 c["predicted_tok_s"], c["achieved_tok_s"]]
                for r in data["rows"] if (c := r.get("controller"))]
    if ctl_rows:
        parts += ["Depth controller (rows without `k=`): depths chosen per request and step "
                  "(depth:count), steps with no drafts at all, and its own decayed estimates "
                  "at the end of the run (tokens/s of whole decode cycles, batch total).",
                  report.markdown_table(["method", "depth histogram", "mean depth",
                                         "plain steps", "predicted tok/s",
                                         "achieved tok/s"], ctl_rows)]
    if cost_rows:
        parts += ["Cost model: predicted = L·T1 / (R·Tm + Tv) (see `speed.cost_model`). "
                  "L tokens per full-cache step, R middle rounds per step, T1 plain decode "
                  "step, Tv verification step (gamma+1 query tokens), Tm middle round; "
                  "times in ms per batched step; T1, Tv and two-level Tm measured in "
                  "isolation on plain vLLM; the in-situ columns are what TriForce's steps "
                  "actually cost.",
                  report.markdown_table(
                      ["method", "L", "R", "T1", "Tv", "Tm", "in-situ middle round",
                       "of which host (not forwards)", "in-situ rest of step", "predicted", "achieved",
                       "achieved / predicted"], cost_rows)]
    report.write_markdown(path, "bench speed", parts)
