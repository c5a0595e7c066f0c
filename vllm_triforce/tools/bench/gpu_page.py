"""benchmarks/RESULTS.md's section of a `vllm-triforce bench gpu` run (kind "gpu"): the
exactness and syncs of its jobs, and the cost table at Llama-3.1-8B's shape with its
projection (bench/gpu_summary.py)."""

from __future__ import annotations

from vllm_triforce.tools.bench.gpu_render import projection_cell
from vllm_triforce.tools.bench.gpu_summary import PROJECTION
from vllm_triforce.tools.bench.report import markdown_table


def gpu_section(data: dict, case: Case) -> tuple[str, ...]:
    summary = data["summary"]
    exact = {e["job"]: e for e in summary["exactness"]}
    syncs = {s["job"]: s for s in summary["syncs"]}
    header = ["job", "backend", "= plain", "divergences all at near-ties", "drafted / accepted",
              "middle drafted / accepted", "vLLM's syncs / step", "TriForce's syncs / step"]
    stale = set(summary.get("stale", ()))  # judged by no current reference
    rows = [_gpu_row(job, exact.get(job), syncs.get(job))
            for job in data["jobs"] if job in exact and job not in stale]
    # the plain references have syncs only: one sentence, not a row of empty cells each
    plain = [f"{job} {syncs[job]['vllm_per_step']:.2f}" for job in data["jobs"]
             if job in syncs and job not in exact and job not in stale]
    plain_syncs = f"Plain vLLM's own syncs per step: {', '.join(plain)}. " if plain else ""
    costs = [[row["case"], _ms_cell(row.get("plain_defaults_ms")),
              _ms_cell(row.get("plain_forced_ms")), _tax_cell(row.get("tax")), ", ".join(
                  f"k={k}: {_ms_cell(d.get('step_ms'))}" for k, d in row["depths"].items())
              or "not measured", projection_cell(row.get("projection")),
              row.get("reference") or ""]
             for row in summary.get("costs", [])]
    cost_table = ("Costs at Llama-3.1-8B's shape (random weights), ms per decode step; the "
                  f"projection is {PROJECTION}:\n\n"
                  + markdown_table(["case", "plain, vLLM defaults", "plain, TriForce's settings",
                                    "tax", "TriForce at depth k", "projected speedup",
                                    "speedups against"], costs)
                  if costs else "")
    return ("", markdown_table(header, rows),
            f"{plain_syncs}{_kernels(data)} {_job_states(data)}", cost_table)


def _ms_cell(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _tax_cell(value) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def _yes(value) -> str:
    return {True: "yes", False: "no"}.get(value, "n/a") if isinstance(value, bool) else "n/a"


def gpu_glance(data: dict) -> str:
    summary = data["summary"]
    exact = summary["exactness"]
    if all(e["identical"] for e in exact):
        tokens = "gave plain vLLM's tokens"
    elif all(e["identical"] or e["explained"] for e in exact):
        tokens = "gave plain vLLM's tokens but at near-ties of plain's own log-probs"
    else:
        tokens = "did NOT give plain vLLM's tokens"
    per_step = max(s["triforce_per_step"] for s in summary["syncs"])
    states = _states(data)
    return (f"{len(states.get('ok', []))} of {len(data['jobs'])} jobs ran; drafting jobs "
            f"{tokens}; TriForce's syncs per step at most {per_step:.1f}; failed: "
            f"{len(states.get('failed', []))}, not run: {len(states.get('not run', []))}")


def _gpu_row(job: str, exact: dict, syncs: dict | None) -> list[str]:
    pair = "{} / {}".format
    return [job, exact.get("backend", ""), _yes(exact["identical"]), _yes(exact["explained"]),
            pair(exact["drafted"], exact["accepted"]),
            pair(exact["middle_drafted"], exact["middle_accepted"]),
            f"{syncs['vllm_per_step']:.2f}" if syncs else "",
            f"{syncs['triforce_per_step']:.2f}" if syncs else ""]


def _kernels(data: dict) -> str:
    result = (data["jobs"].get("kernels") or {}).get("result") or {}
    checks = [f"`{name}` {'ok' if r['ok'] else 'FAILED'} (max error {r['max_error']:.2g})"
              for name, r in result.items() if isinstance(r, dict) and "ok" in r]
    return f"Kernels against torch references: {', '.join(checks)}." if checks else ""


def _states(data: dict) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for job, entry in data["jobs"].items():
        states.setdefault(entry["status"], []).append(job)
    return states


def _job_states(data: dict) -> str:
    return "Jobs: " + "; ".join(f"{status}: {', '.join(jobs)}"
                                for status, jobs in _states(data).items()) + "."
