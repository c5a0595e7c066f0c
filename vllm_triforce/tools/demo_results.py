"""The results of a `vllm-triforce demo --out FILE` run (the GPU run's, benchmarks/gpu/):
JSON written after every round, so a run cut short keeps what it measured, and its
results.md; where a TriForce decode's time went, from its counters."""

from __future__ import annotations

import json
import os
import statistics
import time

from vllm_triforce.tools.demo_engine import DRAFT_COUNTS

ROUND_GRAPH_COUNTS = ("round_graph_passes", "round_graph_ahead", "round_graph_misses")

GPU_RESULTS = "benchmarks/gpu/real_model_2026-11-27/results.md"


def acceptance(counts: dict) -> float | None:
    """Drafts vLLM accepted over drafts it verified (None: nothing verified)."""
    return counts["top_accepted"] / counts["top_proposed"] if counts["top_proposed"] else None


def identical(plain: dict, tri: dict, fixed: dict) -> bool:
    """Every TriForce output equals plain vLLM's, and each engine's equal every round."""
    return (plain["tokens"] == tri["tokens"] == fixed["tokens"]
            and plain["same_each_round"] and tri["same_each_round"])


def verdict_text(v: dict) -> str:
    """One line: identical, or where each diverging sequence first differs and plain
    vLLM's top-2 log-prob margin there (bench/gpu_summary.compare_tokens)."""
    if v["identical"]:
        return f"identical ({v['sequences']} sequences)"
    where = ", ".join(f"seq {d['sequence']} at {d['position']} (plain margin "
                      f"{d['plain_margin']:.4f})" if d["plain_margin"] is not None else
                      f"seq {d['sequence']} at {d['position']} (no margin)"
                      for d in v["divergences"])
    return (f"{len(v['divergences'])} of {v['sequences']} sequences diverge: {where}; "
            f"{'all at near-ties' if v['explained'] else 'NOT ALL AT NEAR-TIES'}")


def step_costs(run: dict, new_tokens: int) -> dict:
    """Where one TriForce decode's time went, from its own counters: per vLLM step, the
    proposer's share (middle rounds, selection, bookkeeping) and the rest (vLLM's
    verification pass, sampling, scheduling); per middle round, the model forward's share;
    the tokens each request gained per step (`new_tokens`: per request)."""
    c = run["triforce"]
    steps = c["plain_steps"] + c["drafting_steps"]
    decode_ms, proposer_ms = 1000 * run["decode_s"], 1000 * c["middle_seconds"]
    rounds = c["middle_rounds"]
    return {"steps": steps, "tokens_per_step": new_tokens / steps if steps else None,
            "ms_per_step": decode_ms / steps if steps else None,
            "proposer_ms_per_step": proposer_ms / steps if steps else None,
            "vllm_ms_per_step": (decode_ms - proposer_ms) / steps if steps else None,
            "middle_rounds_per_step": rounds / steps if steps else None,
            "ms_per_middle_round": proposer_ms / rounds if rounds else None,
            "forward_ms_per_middle_round": 1000 * c["forward_seconds"] / rounds if rounds
            else None}


def _machine() -> dict:
    import platform

    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu,
            "cpu": f"{_cpu_model() or platform.machine()}, {os.cpu_count()} cores",
            "vllm": vllm.__version__, "torch": torch.__version__,
            "commit": source_commit()}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def source_commit() -> str | None:
    """The commit this code is from: `VLLM_TRIFORCE_COMMIT` (a lent GPU's copy of the tree
    has no .git), else git's short hash."""
    import subprocess

    if os.environ.get("VLLM_TRIFORCE_COMMIT"):
        return os.environ["VLLM_TRIFORCE_COMMIT"]

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        return None


def run_rows(runs: list[dict], args) -> list[dict]:
    rows = []
    for r in runs:
        row = {"tok_s": r["tok_s"], "decode_s": r["decode_s"]}
        if "triforce" in r:
            c = r["triforce"]
            row.update({k: c[k] for k in DRAFT_COUNTS}, depth_counts=c["depth_counts"],
                       costs=step_costs(r, args.max_tokens))
        rows.append(row)
    return rows


def save_rounds(args, rounds: dict, modes: dict) -> None:
    """The rounds so far (a run cut short keeps what it measured)."""
    data = {"machine": _machine(), "args": vars(args) | {"func": None}, "engines": modes,
            "rounds": {name: run_rows(runs, args) for name, runs in rounds.items()},
            "complete": False}
    write_json(args.out, data)


def save(args, plain, tri, fixed, verdict, fixed_verdict) -> None:
    ratios = [t / p for t, p in zip(tri["round_tok_s"], plain["round_tok_s"])]
    fixed_ratios = ([t / p for t, p in zip(fixed["round_tok_s"], plain["round_tok_s"])]
                    if len(fixed["round_tok_s"]) == len(plain["round_tok_s"]) else  # CPU: once
                    [t / statistics.median(plain["round_tok_s"]) for t in fixed["round_tok_s"]])
    m = tri["metrics"]
    data = {"machine": _machine(), "args": vars(args) | {"func": None},
            "engines": {"plain": plain["engine"], "triforce": tri["engine"]},
            "plain_tok_s": plain["round_tok_s"], "triforce_tok_s": tri["round_tok_s"],
            "fixed_tok_s": fixed["round_tok_s"],
            "speedup": {"rounds": ratios, "median": statistics.median(ratios)},
            "fixed_speedup": {"rounds": fixed_ratios, "median": statistics.median(fixed_ratios)},
            "plain_ms_per_step": [1000 * args.batch / t for t in plain["round_tok_s"]],
            # cumulative over the TriForce engine's runs (warm-up, controller and fixed)
            "vllm_counters": {"drafted": m.get("vllm:spec_decode_num_draft_tokens"),
                              "accepted": m.get("vllm:spec_decode_num_accepted_tokens")},
            "controller": {k: tri["triforce"][k] for k in (*DRAFT_COUNTS, "depth_counts",
                                                            "plain_steps", "drafting_steps",
                                                            *ROUND_GRAPH_COUNTS)},
            "fixed": {k: fixed["triforce"][k] for k in (*DRAFT_COUNTS, "depth_counts",
                                                        *ROUND_GRAPH_COUNTS)},
            "rounds": {"triforce": run_rows(tri["rounds"], args),
                       "fixed": run_rows(fixed["rounds"], args)},
            "verdict": verdict, "fixed_verdict": fixed_verdict,
            "same_each_round": {"plain": plain["same_each_round"],
                                "triforce": tri["same_each_round"]},
            "eager_check": fixed.get("eager_check"),
            "first_continuation": tri["text"][:300], "complete": True}
    write_json(args.out, data)


def write_json(path, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(data: dict) -> str:
    """results.md of a demo run saved with `--out` (its results.json)."""
    m, a = data["machine"], data["args"]
    rounds = lambda xs: ", ".join(f"{x:.0f}" if x >= 1000 else f"{x:.1f}" for x in xs)  # noqa: E731
    ratios = lambda s: ", ".join(f"{x:.2f}x" for x in s["rounds"])  # noqa: E731
    lines = [
        f"# TriForce against plain vLLM on a real model: {a['batch']} x {a['prompt_tokens']} "
        f"Moby-Dick tokens, {a['max_tokens']} new, greedy",
        "",
        f"{m['date']}, {m['gpu'] or m['cpu']}; vLLM {m['vllm']}, torch {m['torch']}, commit "
        f"{m['commit']}. `vllm-triforce demo --device {a['device']} --out results.json"
        f"{' --eager-check' if a.get('eager_check') else ''}`: SmolLM2-135M in {a['dtype']}, "
        f"TriForce two levels, retrieval budget {a['budget']}, gamma {a['gamma']}. Engines: "
        + (f"plain {data['engines']['plain']['mode']} with vLLM's defaults, TriForce "
           f"{data['engines']['triforce']['mode']} with its forced settings."
           if a["device"] == "cuda" else
           "both eager with blocks of 32 tokens (vLLM's CPU settings for exact comparison)."),
        "",
        "| engine | decode tok/s per round | speedup per round | median |",
        "|---|---|---|---|",
        f"| plain vLLM{' (defaults)' if a['device'] == 'cuda' else ''} | "
        f"{rounds(data['plain_tok_s'])} | | |",
        f"| TriForce, depth controller | {rounds(data['triforce_tok_s'])} | "
        f"{ratios(data['speedup'])} | {data['speedup']['median']:.2f}x |",
        f"| TriForce, fixed depth {a['gamma']} | {rounds(data['fixed_tok_s'])} | "
        f"{ratios(data['fixed_speedup'])} | {data['fixed_speedup']['median']:.2f}x |",
        "",
    ]
    for name, key in (("controller", "verdict"), (f"fixed depth {a['gamma']}", "fixed_verdict")):
        lines.append(f"- Outputs against plain vLLM, {name}: {verdict_text(data[key])}.")
    c, f = data["controller"], data["fixed"]
    lines += [
        f"- Drafts verified by vLLM (proposed / accepted): controller {c['top_proposed']} / "
        f"{c['top_accepted']} (acceptance {c['top_accepted'] / max(c['top_proposed'], 1):.3f}), "
        f"fixed depth {f['top_proposed']} / {f['top_accepted']} "
        f"(acceptance {f['top_accepted'] / max(f['top_proposed'], 1):.3f}); vLLM's own "
        f"counters over the TriForce engine: {data['vllm_counters']['accepted']} / "
        f"{data['vllm_counters']['drafted']} accepted.",
        f"- Depth controller: {c['plain_steps']} of {c['plain_steps'] + c['drafting_steps']} "
        "steps plain; request-steps by depth "
        + ", ".join(f"{k}: {n}" for k, n in enumerate(c["depth_counts"]) if n) + ".",
    ]
    lines.append("- Plain vLLM's step per round: " + ", ".join(
        f"{x:.2f}" for x in data["plain_ms_per_step"]) + " ms; TriForce's, split by level, "
        "below.")
    if data.get("eager_check"):
        e = data["eager_check"]
        lines.append(f"- CUDA graphs and the capture: fixed-depth acceptance compiled "
                     f"{e['compiled_acceptance']:.3f}, eager {e['eager_acceptance']:.3f} "
                     f"({'within' if e['agree'] else 'NOT within'} 3 points).")
    lines += ["", "Where a step's time goes (per round, from TriForce's counters):", "",
              "| run | ms per step | tokens per request per step | proposer ms | vLLM ms "
              "| middle rounds per step | ms per middle round | of which model forward |",
              "|---|---|---|---|---|---|---|---|"]
    for name in ("triforce", "fixed"):
        for row in data["rounds"][name]:
            k = row["costs"]
            lines.append(f"| {'controller' if name == 'triforce' else 'fixed'} | "
                         f"{_ms(k['ms_per_step'])} | {_ms(k['tokens_per_step'])} | "
                         f"{_ms(k['proposer_ms_per_step'])} | {_ms(k['vllm_ms_per_step'])} | "
                         f"{_ms(k['middle_rounds_per_step'])} | {_ms(k['ms_per_middle_round'])}"
                         f" | {_ms(k['forward_ms_per_middle_round'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------- benchmarks/RESULTS.md (kind "demo")

def demo_glance(data: dict) -> str:
    """The at-a-glance cell of a demo run."""
    m, a, f = data["machine"], data["args"], data["fixed"]
    same = data["verdict"]["identical"] and data["fixed_verdict"]["identical"]
    return (f"{m['gpu'] or 'CPU'}: plain {statistics.median(data['plain_tok_s']):.0f} tok/s; "
            f"TriForce controller {data['speedup']['median']:.2f}x, depth {a['gamma']} "
            f"{data['fixed_speedup']['median']:.2f}x (acceptance "
            f"{f['top_accepted'] / max(f['top_proposed'], 1):.3f}); outputs "
            f"{'identical' if same else 'NOT identical'}, {f['top_proposed']} drafts verified")


def demo_section(data: dict, case) -> tuple[str, str]:
    """(shape line, tables) of a demo run's section: its own results.md body."""
    body = markdown(data).split("\n", 3)[3]  # without its title and provenance lines
    body = body.split("\nWhere a step's time goes")[0]  # that table stays in results.md
    a = data["args"]
    shape = (f"Shape: {a['batch']} x {a['prompt_tokens']}-token Moby-Dick prompts, "
             f"{a['max_tokens']} new tokens, {a['dtype']}, retrieval budget {a['budget']}, "
             f"up to {a['gamma']} drafts a step; rounds {a['rounds']}.")
    return shape, body.strip()


def recorded(data: dict) -> dict:
    """Date, commit and machine as a demo run's results.json records them."""
    m = data["machine"]
    where = m["gpu"] or f"CPU {m['cpu']}"
    return {"machine": f"{where}; vLLM {m['vllm']}, torch {m['torch']}", "date": m["date"],
            "commit": m["commit"]}


# ------------------------------------------------------ the terminal's table

def report(plain: dict, tri: dict, fixed: dict, args) -> None:
    """The table: decode tok/s per round and median, speedups, acceptance, drafts
    verified, identity; what the controller chose; where TriForce pays."""
    ratios = [t / p for t, p in zip(tri["round_tok_s"], plain["round_tok_s"])]
    fixed_ratios = ([t / p for t, p in zip(fixed["round_tok_s"], plain["round_tok_s"])]
                    if len(fixed["round_tok_s"]) == len(plain["round_tok_s"]) else
                    [t / statistics.median(plain["round_tok_s"]) for t in fixed["round_tok_s"]])
    cells = lambda xs, f: "  ".join(f.format(x) for x in xs)  # noqa: E731
    width = 9 * max(args.rounds, 1)
    rows = [("plain vLLM", plain["round_tok_s"], None),
            ("TriForce, controller", tri["round_tok_s"], ratios),
            (f"TriForce, depth {args.gamma}", fixed["round_tok_s"], fixed_ratios)]
    print(f"\n{'':24}{'decode tok/s per round':<{width}}  median  "
          f"{'speedup per round':<{width}}  median")
    for name, tok_s, speed in rows:
        print(f"{name:<24}{cells(tok_s, '{:7.1f}'):<{width}}  {statistics.median(tok_s):6.1f}  "
              + (f"{cells(speed, '{:6.2f}x'):<{width}}  {statistics.median(speed):5.2f}x"
                 if speed else ""))
    s, f = tri["triforce"], fixed["triforce"]
    same = identical(plain, tri, fixed)
    print(f"acceptance (drafts vLLM accepted): controller {_rate(s)}, depth {args.gamma} "
          f"{_rate(f)}")
    steps = s["plain_steps"] + s["drafting_steps"]
    hist = ", ".join(f"{k}: {n}" for k, n in enumerate(s["depth_counts"]) if n)
    print(f"depth controller: {s['plain_steps']} of {steps} steps plain (request-steps by "
          f"depth {hist})")
    print(f"outputs identical to plain vLLM: {'YES' if same else 'NO'} (drafts verified by "
          f"vLLM, proposed / accepted: controller {_drafts(s)}, fixed k={args.gamma} "
          f"{_drafts(f)})")
    if getattr(args, "round_graphs", False):
        print(f"round graphs: {_round_graphs(s)} (controller), {_round_graphs(f)} "
              f"(fixed k={args.gamma})")
    print(_where_it_pays(args, statistics.median(ratios)))


def _round_graphs(counts: dict) -> str:
    """What took the round graphs (`--round-graphs`): passes replayed over the buffers, of
    them loaded ahead, and passes that fit no bucket."""
    return (f"{counts.get('round_graph_passes', 0)} passes replayed "
            f"({counts.get('round_graph_ahead', 0)} loaded ahead), "
            f"{counts.get('round_graph_misses', 0)} per pass")


def _rate(counts: dict) -> str:
    rate = acceptance(counts)
    return "-" if rate is None else f"{rate:.2f}"


def _drafts(counts: dict) -> str:
    """`proposed / accepted` at the top level, and at the middle level if the small draft
    proposed."""
    text = f"{counts['top_proposed']} / {counts['top_accepted']}"
    if counts["middle_proposed"]:
        text += (f" (small draft to middle level {counts['middle_proposed']} / "
                 f"{counts['middle_accepted']})")
    return text


def _where_it_pays(args, speedup: float) -> str:
    if args.device == "cpu":
        return ("Where TriForce pays: on a CPU vLLM's attention verifies k drafts for 2-4 "
                "decode steps' price, so drafting pays only where the KV cache outweighs the "
                "weights, and the depth controller drafts where its measurements say it pays "
                f"({speedup:.2f}x here); on a GPU verification costs about one step, but "
                f"TriForce's own passes are host-bound today ({GPU_RESULTS}).")
    return (f"TriForce here: {speedup:.2f}x; where each step's milliseconds go is in the "
            f"results (--out), as in {GPU_RESULTS}.")


def save_results(args, plain, tri, fixed) -> int:
    """The verdicts against plain vLLM, where a step's time went, the JSON (`--out`); the
    exit status."""
    from vllm_triforce.tools.bench.gpu_summary import compare_tokens

    verdict = compare_tokens(plain["tokens"], tri["tokens"], plain.get("margins"))
    fixed_verdict = compare_tokens(plain["tokens"], fixed["tokens"], plain.get("margins"))
    if args.device == "cuda":
        print(f"verdict against plain vLLM: controller {verdict_text(verdict)}; fixed "
              f"k={args.gamma} {verdict_text(fixed_verdict)}")
    for name, run in (("controller", tri), (f"fixed k={args.gamma}", fixed)):
        c = step_costs(run["rounds"][-1], args.max_tokens)
        print(f"TriForce {name}, last round: {_ms(c['ms_per_step'])} ms per step "
              f"({_ms(c['tokens_per_step'])} tokens per request per step), of which proposer "
              f"{_ms(c['proposer_ms_per_step'])} ms, vLLM {_ms(c['vllm_ms_per_step'])} ms; "
              f"{_ms(c['middle_rounds_per_step'])} middle rounds per step at "
              f"{_ms(c['ms_per_middle_round'])} ms ({_ms(c['forward_ms_per_middle_round'])} "
              "ms of model forward)", flush=True)
    save(args, plain, tri, fixed, verdict, fixed_verdict)
    print(f"results: {args.out}", flush=True)
    if "eager_check" in fixed and not fixed["eager_check"]["agree"]:
        return 1
    if args.device == "cpu":  # float32: nothing but identical passes
        return 0 if identical(plain, tri, fixed) else 1
    return 0 if verdict["explained"] and fixed_verdict["explained"] else 1
