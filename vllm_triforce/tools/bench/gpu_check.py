"""`vllm-triforce bench gpu`: TriForce inside real vLLM on a GPU -- exactness, syncs, memory,
and what each level costs -- written to results.json / results.md as each engine finishes.

Any user with a GPU and vLLM installed can run it (no weights needed: the models are built
on the spot); on an air-gapped GPU machine, `scripts/gpu_run.sh` runs it from an offline
bundle (scripts/gpu_bundle.py). Without CUDA it is a dry run of the same jobs on tiny
shapes with CPU_ATTN (seconds; tests/test_gpu_check.py runs it in CI), so no GPU minute
is lost to a Python error.

This module holds the command and the scheduling: which jobs still need to run, in what
order, within what budget, and saving after each. The rest, by job:
* bench/gpu_plan.py: the jobs (kernels, exactness, costs) and each engine's settings;
* bench/gpu_launch.py: one job in a child process (bench/gpu_job.py, whose costs job is
  bench/gpu_costs.py and whose engine is built and read by bench/gpu_engine.py), the run's
  machine;
* bench/gpu_summary.py: what the results conclude (results.json's "summary");
* bench/gpu_render.py: results.md.

Resumable: jobs already "ok" in `--resume` (or the output's own results.json) are kept and
not run again; `--budget-s` stops starting jobs that would not finish in time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vllm_triforce.tools.bench.gpu_launch import environment, run_job
from vllm_triforce.tools.bench.gpu_plan import plan
from vllm_triforce.tools.bench.gpu_render import render
from vllm_triforce.tools.bench.gpu_summary import summarise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--resume", type=Path, default=None,
                   help="a results.json whose finished jobs are kept (default: --out's own)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer folder (default: SmolLM2-135M's, fetched)")
    p.add_argument("--models", type=Path, default=None,
                   help="where the built models go (default: <out>/models)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no job that would end after this many seconds")
    p.add_argument("--only", default=None,
                   help="comma-separated job names or prefixes (e.g. exact,costs-triforce)")
    p.add_argument("--cases", default=None,
                   help="comma-separated cost cases to run now (default: all; e.g. 8x32K)")
    p.add_argument("--redo", action="store_true", help="run jobs already done again")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes and CPU sizes even on a GPU machine")
    p.add_argument("--acceptance", type=Path, nargs="+", default=None,
                   help="`bench acceptance` results.json files: the default policy's "
                        "acceptance on real text, from which the cost table projects speedups")
    p.add_argument("--summarise", action="store_true",
                   help="run no job: rebuild the summary and results.md of --out's results "
                        "(with --acceptance, after recording it)")


def handle(args: argparse.Namespace) -> int:
    results = summarise_only(args) if args.summarise else run(args)
    print(render(results))
    print(args.out)
    return 0 if all(j["status"] == "ok" for j in results["jobs"].values()) else 1


# ---------------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> dict:
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    results = _load(args.resume or args.out / "results.json")
    if args.acceptance:
        results["acceptance"] = acceptance_points(args.acceptance)
    results.setdefault("runs", []).append(environment())
    results.setdefault("jobs", {})
    models = _models(args, on_gpu)
    started = time.monotonic()
    jobs = plan(on_gpu, models)
    wanted = [w for w in (args.only or "").split(",") if w]
    i = 0
    while i < len(jobs):
        job = jobs[i]
        i += 1
        if wanted and not any(job["name"].startswith(w) for w in wanted):
            continue
        previous = results["jobs"].get(job["name"], {})
        if job["kind"] == "costs":
            job = _missing_cases(job, previous, args)
        if job is None or (previous.get("status") == "ok" and job["kind"] != "costs"
                           and previous.get("model_tag") == job.get("model_tag")
                           and not args.redo):
            continue
        elapsed = time.monotonic() - started
        if args.budget_s is not None and elapsed + job["estimate_s"] > args.budget_s:
            results["jobs"].setdefault(job["name"], {"status": "not run"})
            continue
        timeout = job["timeout_s"]
        if args.budget_s is not None:  # a job never outlives the budget by more than a minute
            timeout = min(timeout, max(60.0, args.budget_s + 60.0 - elapsed))
        entry = run_job(job, args.out, len(results["runs"]) - 1, timeout)
        results["jobs"][job["name"]] = _merge_cases(previous, entry)
        if job["name"] == "kernels" and on_gpu and not _kernels_ok(results):
            jobs = jobs[:i] + plan(on_gpu, models, kernels_ok=False)[i:]
        if (job["kind"] == "costs" and entry["status"] != "ok"
                and not job["llm"].get("enforce_eager") and _compile_failure(entry)):
            # torch.compile or CUDA graphs failed (this torch is older than vLLM's pin?):
            # this job again without AOT compile; failed again, the remaining cost jobs,
            # and this one at the end, run eager (and say so: bench/gpu_summary.FALLBACKS)
            if not job["name"].endswith(NO_AOT):
                jobs = jobs[:i] + [_no_aot(job)] + jobs[i:]
            else:
                jobs = jobs[:i] + [_eager(j) for j in jobs[i:]] + [_eager(job)]
        results["summary"] = summarise(results)
        _save(args.out, results)
    results["summary"] = summarise(results)
    _save(args.out, results)
    return results


def summarise_only(args: argparse.Namespace) -> dict:
    results = _load(args.resume or args.out / "results.json")
    if not results:
        raise SystemExit(f"bench gpu --summarise: no results.json in {args.out}")
    if args.acceptance:
        results["acceptance"] = acceptance_points(args.acceptance)
    results["summary"] = summarise(results)
    _save(args.out, results)
    return results


def acceptance_points(paths: list[Path]) -> dict:
    """The default policy's acceptance (sum of min(p, q) at the bench's temperature) and
    greedy agreement on the prose rows of `bench acceptance` results, per context and
    budget: what the cost table's projection multiplies the GPU's step costs by."""
    points, sources = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        config = data["config"]
        for cell in data["cells"] + data.get("sweep", []):
            if cell["policy"] == data["default_policy"] and cell["task"] != "needle":
                points.append({"context": config["context_tokens"],
                               "budget": cell["budget_tokens"], "task": cell["task"],
                               "acceptance": cell["acceptance"],
                               "greedy_agreement": cell.get("greedy_agreement"),
                               "model": Path(config["model"]).name,
                               "temperature": config["temperature"]})
        sources.append(str(path))
    if not points:
        raise SystemExit(f"bench gpu --acceptance: no default-policy prose rows in {paths}")
    return {"source": ", ".join(sources), "points": points}


NO_AOT = "-noaot"
# The exceptions a failed engine's log ends in when torch.compile failed (words such as
# "compilation" are in every engine's log, so only exception names count).
COMPILE_FAILURES = ("torch._dynamo.exc.", "torch._inductor.exc.", "InductorError",
                    "BackendCompilerFailed")


def _compile_failure(entry: dict) -> bool:
    error = entry.get("error") or ""
    return any(marker in error for marker in COMPILE_FAILURES)


def _no_aot(job: dict) -> dict:
    """The job again with vLLM's AOT compile off (VLLM_USE_AOT_COMPILE=0)."""
    return {**job, "name": job["name"] + NO_AOT,
            "env": {**job.get("env", {}), "VLLM_USE_AOT_COMPILE": "0"}}


def _eager(job: dict) -> dict:
    if job["kind"] != "costs" or job["llm"].get("enforce_eager"):
        return job
    llm = {k: v for k, v in job["llm"].items() if k != "compilation_config"}
    env = {k: v for k, v in job.get("env", {}).items() if k != "VLLM_USE_AOT_COMPILE"}
    return {**job, "name": job["name"].removesuffix(NO_AOT) + "-eager", "env": env,
            "llm": {**llm, "enforce_eager": True}}


def _missing_cases(job: dict, previous: dict, args) -> dict | None:
    """The cost job restricted to the cases it still lacks (and `--cases` asks for), or
    None when nothing is left: a later run completes an earlier one case by case."""
    done = set() if args.redo else set(
        (previous.get("result") or previous.get("partial") or {}).get("cases", {}))
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in job["cases"] if c["name"] not in done
             and (wanted is None or c["name"] in wanted)]
    return {**job, "cases": cases} if cases else None


def _merge_cases(previous: dict, entry: dict) -> dict:
    """A cost job's new cases added to those an earlier run measured."""
    old = previous.get("result") or previous.get("partial")
    if not old or "cases" not in old:
        return entry
    key = "result" if entry["status"] == "ok" else "partial"
    new = entry.get(key) or {}
    merged = {**old, **{k: v for k, v in new.items() if k != "cases"},
              "cases": {**old.get("cases", {}), **new.get("cases", {})}}
    status = "ok" if previous.get("status") == "ok" or entry["status"] == "ok" else "failed"
    return {**entry, "status": status, "result" if status == "ok" else "partial": merged}


def _kernels_ok(results: dict) -> bool:
    kernels = results["jobs"].get("kernels", {}).get("result", {})
    return bool(kernels.get("flash_attn_3", {}).get("ok")) and bool(
        kernels.get("rms_norm", {}).get("ok"))


def _models(args, on_gpu: bool) -> dict:
    from vllm_triforce.tools.bench import gpu_models

    tokenizer = args.tokenizer
    if tokenizer is None:
        from vllm_triforce import assets

        tokenizer = assets.ensure_model("smollm2-135m")
    root = args.models or args.out / "models"
    target, draft = gpu_models.build_tiny_pair(root, Path(tokenizer))
    shape = (gpu_models.write_llama_8b_shape(root / "llama-3.1-8b-shape", Path(tokenizer))
             if on_gpu else target)
    return {"target": target, "draft": draft, "shape": shape, "tag": gpu_models.TINY_TAG,
            "sampling": gpu_models.build_sampling_model(root, Path(tokenizer)),
            "windowed": (gpu_models.build_windowed_model(root, Path(tokenizer))
                         if on_gpu else None),
            "vocab": gpu_models.tokenizer_vocab_size(Path(tokenizer))}


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path and path.exists() else {}


def _save(out: Path, results: dict) -> None:
    """results.json and results.md in `out`, and in $VLLM_TRIFORCE_GPU_MIRROR if set
    (scripts/gpu_run.sh: the folder a sandboxed run's results are fetched from, kept
    current in case the run is killed)."""
    mirror = os.environ.get("VLLM_TRIFORCE_GPU_MIRROR")
    for folder in (out, Path(mirror) if mirror else None):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_text(json.dumps(results, indent=1))
            (folder / "results.md").write_text(render(results))
