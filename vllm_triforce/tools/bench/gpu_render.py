"""results.md of `vllm-triforce bench gpu` (bench/gpu_check.py): the runs' environment, each
job's status, and the summary (bench/gpu_summary.py) as tables.
"""

from __future__ import annotations

from vllm_triforce.tools.bench.gpu_summary import ALPHA, MARGIN_EPS, PROJECTION, summarise


def render(results: dict) -> str:
    runs = results.get("runs", [])
    last = runs[-1] if runs else {}
    lines = ["# TriForce inside vLLM on a GPU (`vllm-triforce bench gpu`)", "",
             f"Last run {last.get('date')} at {last.get('commit')}: {last.get('gpu', 'no GPU')}"
             f", CPU {last.get('cpu')}; vLLM {last.get('vllm')}, torch {last.get('torch')}, "
             f"Triton {last.get('triton')}, transformers {last.get('transformers')}.", "",
             "| job | status | s |", "|---|---|---|"]
    for name, job in results.get("jobs", {}).items():
        lines.append(f"| {name} | {job['status']} | {job.get('seconds', '')} |")
    summary = results.get("summary") or summarise(results)
    lines += ["", "## Exactness (greedy, drafting forced)", "",
              f"A divergence is explained when plain vLLM's own top-2 log-prob margin there is "
              f"below {MARGIN_EPS} nats (a near-tie that a pass of another shape may round "
              "the other way).", "",
              "| job | backend | identical | divergences (position: plain top-2 margin) "
              "| all explained | drafted / accepted | middle drafted / accepted |",
              "|---|---|---|---|---|---|---|"]
    for r in summary["exactness"]:
        div = ", ".join(f"{d['position']}: {_f(d['plain_margin'])}" for d in r["divergences"])
        lines.append(f"| {r['job']} | {r['backend']} | {r['identical']} | {div or '-'} | "
                     f"{r['explained']} | {r['drafted']} / {r['accepted']} | "
                     f"{r['middle_drafted']} / {r['middle_accepted']} |")
    if summary.get("stale"):
        lines += ["", "Not compared, their models built by another recipe than their "
                  "reference's (run them again): " + ", ".join(summary["stale"])
                  + "."]
    if summary.get("distribution"):
        lines += ["", "## Sampled output against plain vLLM's distribution", "",
                  "Temperature 1, continuations of one prompt, TriForce's depths forced to "
                  "vary; per drafted token (2, 3, ...) the chi-square p-value of the two "
                  f"samples having one distribution; below {ALPHA} differs. A `-wrong` job "
                  "hands the verifier distributions other than the drafts were drawn from, "
                  "and must be caught.", "",
                  "| job | runner | async | samples | drafted / accepted | p-values "
                  "| verdict |", "|---|---|---|---|---|---|---|"]
        for r in summary["distribution"]:
            runner = (r.get("runner") or "-").rsplit(".", 1)[-1]
            ps = ", ".join(_f(p) for p in r["pvalues"])
            lines.append(f"| {r['job']} | {runner} | {r.get('async_scheduling')} | "
                         f"{r['samples']} | {r['drafted']} / {r['accepted']} | {ps} | "
                         f"{r['verdict']} |")
    lines += ["", "## Syncs", "",
              "Per vLLM step, by the sync debug mode (TriForce's: under the proposer, its middle "
              "rounds included; vLLM's: the rest, patches' wrappers included); inside `propose`, "
              "by the project's SyncCounter: the most in one step outside the middle rounds "
              "and in one middle round.", "",
              "| job | steps | vLLM's per step | TriForce's per step | propose: max per step "
              "| max per middle round |", "|---|---|---|---|---|---|"]
    for r in summary["syncs"]:
        lines.append(f"| {r['job']} | {r.get('steps')} | {_f(r.get('vllm_per_step'))} | "
                     f"{_f(r.get('triforce_per_step'))} | {r.get('propose_max_step', '-')} | "
                     f"{r.get('propose_max_round', '-')} |")
    mem = summary["memory"]
    if mem:
        lines += ["", "## Memory (Llama-3.1-8B shape, TriForce engine)", ""]
        for key, value in mem.items():
            lines.append(f"- {key}: {_mib(key, value)}")
    lines += ["", "## Costs (ms per decode step; TriForce at forced depth k)", "",
              "Tokens per step with random weights say nothing of real text (a constant "
              "output accepts every draft). The projection takes each depth's measured step "
              "and the acceptance of real text at the nearest budget-to-context ratio "
              "(`bench acceptance` on a CPU): " + PROJECTION + ".", "",
              "| case | plain, vLLM defaults | plain, TriForce's settings | tax | depth: step ms "
              "(middle round ms, tokens/step) | projected speedup (best depth; acceptance, "
              "measured at) | against | engines |",
              "|---|---|---|---|---|---|---|---|"]
    for r in summary["costs"]:
        ds = "; ".join(f"{k}: {_f(d.get('step_ms'))} ({_f(d.get('middle_round_ms'))}, "
                       f"{_f(d.get('tokens_per_step'))})" for k, d in r["depths"].items())
        sp = projection_cell(r.get("projection"))
        engines = ", ".join(f"{k}: {v}" for k, v in (r.get("engines") or {}).items() if v)
        lines.append(f"| {r['case']} | {_f(r['plain_defaults_ms'])} | {_f(r['plain_forced_ms'])}"
                     f" | {_pct(r['tax'])} | {ds or '-'} | {sp} | {r.get('reference') or '-'} "
                     f"| {engines or '-'} |")
    on_v2 = [r for r in summary["costs"] if r.get("mrv2_depths")]
    if on_v2:
        lines += ["", "TriForce on vLLM's defaults (Model Runner V2, FULL decode graphs where "
                  "it reads nothing of a pass, async scheduling; experimental):", ""]
        for r in on_v2:
            ds = "; ".join(f"depth {k}: {_f(d.get('step_ms'))} ms"
                           for k, d in r["mrv2_depths"].items())
            ratio = r.get("mrv2_depth0_of_defaults")
            of = f", depth 0 at {ratio:.2f}x plain vLLM's defaults' step" if ratio else ""
            lines.append(f"- {r['case']}: {ds}{of}")
    lines += _tax_lines(summary.get("tax") or [])
    return "\n".join(lines) + "\n"


def _tax_lines(rows: list[dict]) -> list[str]:
    """Issue 60's tax split: plain vLLM's step with one setting changed at a time."""
    if not rows:
        return []
    lines = ["", "## Where the tax goes (plain vLLM, ms per decode step, from vLLM's "
             "defaults toward TriForce's settings)", "",
             "| case | setting | ms per step | over vLLM's defaults |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | vLLM's defaults (V2, FULL_AND_PIECEWISE, async; "
                     f"{r['reference'] or '-'}) | {_f(r['defaults_ms'])} | 1 |")
        for e in r["settings"]:
            what = e["label"]
            if "draft_tokens_per_draft" in e:
                what += (f" ({_f(e['draft_tokens_per_draft'])} draft tokens a request-step, "
                         f"acceptance {_f(e.get('acceptance'))})")
            ratio = f"{e['of_defaults']:.2f}x" if e.get("of_defaults") else "-"
            lines.append(f"| {r['case']} | {what} | {_f(e['step_ms'])} | {ratio} |")
        if r.get("mrv2_depth0_ms") is not None:
            ratio = (f"{r['mrv2_depth0_ms'] / r['defaults_ms']:.2f}x" if r["defaults_ms"]
                     else "-")
            lines.append(f"| {r['case']} | TriForce at depth 0 on Model Runner V2 (1 token a "
                         f"request-step in a spec-decode engine) | {_f(r['mrv2_depth0_ms'])} | "
                         f"{ratio} |")
    return lines


def projection_cell(p: dict | None) -> str:
    if not p or p.get("speedup") is None:
        return "-"
    at = p["measured_at"]
    return (f"{p['speedup']:.2f}x at depth {p['depth']} (acceptance {p['acceptance']:.2f}, "
            f"budget {at['budget']:,} of {at['context']:,} tokens)")


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _mib(key: str, value) -> str:
    if key.endswith("bytes") or key.endswith("given_up") or key.startswith("max_reserved"):
        return f"{value / 2**20:.1f} MiB" if isinstance(value, (int, float)) else str(value)
    if isinstance(value, dict):  # a nested engine's figures (kv_kept), each as above
        return "; ".join(f"{k} {_mib(k, v)}" for k, v in value.items())
    return str(value)
