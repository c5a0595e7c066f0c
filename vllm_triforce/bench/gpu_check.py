"""`vllm-triforce bench gpu`: TriForce inside real vLLM on a GPU -- exactness, syncs, memory,
and what each level costs -- written to results.json / results.md as each engine finishes.

Any user with a GPU and vLLM installed can run it (no weights needed: the models are built
on the spot); on an air-gapped GPU machine, `scripts/gpu_run.sh` runs it from an offline
bundle (scripts/gpu_bundle.py). Without CUDA it is a dry run of the same jobs on tiny
shapes with CPU_ATTN (seconds; tests/test_gpu_check.py runs it in CI), so no GPU minute
is lost to a Python error.

Jobs, each one engine in its own process (bench/gpu_job.py), in order of what matters
first, so that a run cut short still answers the first questions:
1. `kernels`: vLLM's compiled kernels on this torch (stable ABI) against torch references.
2. exactness (tiny random Llama target + draft): plain vLLM, TriForce two and three levels,
   greedy, drafting forced (`adaptive` false), on TRITON_ATTN in float32 (token identity)
   and FLASH_ATTN in bf16 (FlashAttention has no float32: a divergence must sit where
   plain vLLM's own top-2 log-prob margin is below MARGIN_EPS). Plain engines run with
   TriForce's forced settings (V1 runner, PIECEWISE graphs, synchronous scheduling), so
   the syncs per step compare like with like.
3. costs at Llama-3.1-8B's shape (random weights, `load_format="dummy"`): TriForce (memory
   against its reservation; ms per step at forced depths 0..6), plain vLLM with TriForce's
   forced settings, plain vLLM with its own defaults (MRV2, FULL_AND_PIECEWISE graphs,
   async scheduling): the tax the plugin's settings put on a shared server's plain steps.

Resumable: jobs already "ok" in `--resume` (or the output's own results.json) are kept and
not run again; `--budget-s` stops starting jobs that would not finish in time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARGIN_EPS = 0.05  # nats: a bf16 divergence is explained when plain's top-2 margin is below
ALPHAS = (0.8, 0.9)  # the paper's acceptance range, for the cost model's speedups
FORCED_SETTINGS = {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
                   "llm": {"compilation_config": {"cudagraph_mode": "PIECEWISE"},
                           "async_scheduling": False}}
TINY_SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 256,
             "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64,
             "refresh_interval": 1, "adaptive": False}
COST_SPEC = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 4096}
# (name, batch, context): 256K tokens of KV as 8 or 32 requests, and one 128K request;
# MagicDec's gains are at batch 32-256.
GPU_CASES = (("8x32K", 8, 32768 - 512), ("32x8K", 32, 8192 - 512), ("1x128K", 1, 131072 - 1024))
CPU_CASES = (("2x1K", 2, 1024), ("1x2K", 1, 2048))


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


def handle(args: argparse.Namespace) -> int:
    results = run(args)
    print(render(results))
    print(args.out)
    return 0 if all(j["status"] == "ok" for j in results["jobs"].values()) else 1


# --------------------------------------------------------------------------- plan

def plan(on_gpu: bool, models: dict, kernels_ok: bool = True) -> list[dict]:
    """The jobs, in the order they run. `models`: paths of "target", "draft", "shape"."""
    jobs = [{"name": "kernels", "kind": "kernels", "estimate_s": 30, "timeout_s": 120}]
    # eager engines: seconds to start (the cost jobs run the compiled default path)
    backends = ([("triton-fp32", "TRITON_ATTN", "float32")]
                + ([("flash-bf16", "FLASH_ATTN", "bfloat16")] if kernels_ok else [])
                if on_gpu else [("cpu-fp32", "CPU_ATTN", "float32")])
    prompts = _tiny_prompts(models["vocab"])
    for tag, backend, dtype in backends:
        llm = {"dtype": dtype, "enforce_eager": True, "block_size": 32, "seed": 0,
               "max_model_len": 4096, "attention_config": {"backend": backend},
               "gpu_memory_utilization": 0.3}
        if not on_gpu:
            llm.pop("gpu_memory_utilization")
        levels = ((2, 3) if on_gpu else (3,))
        base = {"kind": "generate", "model": str(models["target"]), "prompts": prompts,
                "model_tag": models["tag"],
                "max_tokens": 48, "estimate_s": 30, "timeout_s": 240}
        jobs.append({**base, "name": f"exact-{tag}-plain", "logprobs": 2,
                     "env": FORCED_SETTINGS["env"], "llm": {**llm, "async_scheduling": False}})
        for n in levels:
            spec = dict(TINY_SPEC, **({"model": str(models["draft"]),
                                       "draft_window_tokens": 96,
                                       "draft_tokens_per_round": 2} if n == 3 else {}))
            jobs.append({**base, "name": f"exact-{tag}-{n}L", "spec": spec, "llm": llm,
                         "levels": n, "reference": f"exact-{tag}-plain"})
    jobs.extend(_cost_jobs(on_gpu, models, kernels_ok))
    return jobs


def _tiny_prompts(vocab: int) -> list[list[int]]:
    from vllm_triforce.bench.gpu_job import random_prompts

    # four prompts of 600-900 tokens: well past the retrieval budget (256) and the draft's
    # window (96), so both caches select and re-base
    return [p[:600 + 100 * i] for i, p in enumerate(random_prompts(4, 900, vocab, seed=3))]


def _cost_jobs(on_gpu: bool, models: dict, kernels_ok: bool) -> list[dict]:
    cases = [{"name": n, "batch": b, "context": c} for n, b, c in
             (GPU_CASES if on_gpu else CPU_CASES)]
    # plain engines hold at most the largest case's batch (fewer CUDA graphs to capture);
    # TriForce's holds 256 for the memory check (`many_requests`)
    plain_seqs = max(c["batch"] for c in cases)
    common = {"kind": "costs", "model": str(models["shape"]), "cases": cases,
              "prompt_vocab": models["vocab"],
              "decode_tokens": (8, 40) if on_gpu else (4, 12)}
    if on_gpu:
        llm = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 131072,
               "seed": 0, "gpu_memory_utilization": 0.9,
               "attention_config": {"backend": "FLASH_ATTN" if kernels_ok else "TRITON_ATTN"}}
        sizes = {"estimate_s": 240, "timeout_s": 420}
    else:
        llm = {"load_format": "dummy", "dtype": "float32", "max_model_len": 4096, "seed": 0,
               "enforce_eager": True, "block_size": 32}
        sizes = {"estimate_s": 40, "timeout_s": 300}
    # on CPU the contexts are short: a budget below them, or no request would draft (a
    # request whose context fits the retrieval cache decodes plainly)
    spec = COST_SPEC if on_gpu else {**COST_SPEC, "retrieval_budget": 256}
    triforce = {**common, **sizes, "name": "costs-triforce", "spec": spec,
                "depths": [0, 1, 2, 3, 4, 6] if on_gpu else [0, 2],
                "llm": {**llm, "max_num_seqs": 256 if on_gpu else 8},
                "many_requests": {"num": 256, "context": 1024, "tokens": 8} if on_gpu else None}
    forced = {**common, **sizes, "name": "costs-plain-forced", "env": FORCED_SETTINGS["env"],
              "llm": {**llm, **FORCED_SETTINGS["llm"], "max_num_seqs": plain_seqs}}
    if not on_gpu:
        forced["llm"] = {**llm, "async_scheduling": False, "max_num_seqs": plain_seqs}
        return [triforce, forced]
    defaults = {**common, **sizes, "name": "costs-plain-defaults",
                "llm": {**llm, "max_num_seqs": plain_seqs}}
    return [triforce, forced, defaults]


# ---------------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> dict:
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    results = _load(args.resume or args.out / "results.json")
    results.setdefault("runs", []).append(_environment())
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
        entry = _run_job(job, args.out, len(results["runs"]) - 1, timeout)
        results["jobs"][job["name"]] = _merge_cases(previous, entry)
        if job["name"] == "kernels" and on_gpu and not _kernels_ok(results):
            jobs = jobs[:i] + plan(on_gpu, models, kernels_ok=False)[i:]
        if job["kind"] == "costs" and entry["status"] != "ok" and not job["llm"].get(
                "enforce_eager"):
            # torch.compile or CUDA graphs failed (this torch is older than vLLM's pin?):
            # the remaining cost jobs, and this one again at the end, run eager
            jobs = jobs[:i] + [_eager(j) for j in jobs[i:]] + [_eager(job)]
        results["summary"] = summarise(results)
        _save(args.out, results)
    results["summary"] = summarise(results)
    _save(args.out, results)
    return results


def _eager(job: dict) -> dict:
    if job["kind"] != "costs" or job["llm"].get("enforce_eager"):
        return job
    llm = {k: v for k, v in job["llm"].items() if k != "compilation_config"}
    return {**job, "name": job["name"] + "-eager", "llm": {**llm, "enforce_eager": True}}


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
    from vllm_triforce.bench import gpu_models

    tokenizer = args.tokenizer
    if tokenizer is None:
        from vllm_triforce import assets

        tokenizer = assets.ensure_model("smollm2-135m")
    root = args.models or args.out / "models"
    target, draft = gpu_models.build_tiny_pair(root, Path(tokenizer))
    shape = (gpu_models.write_llama_8b_shape(root / "llama-3.1-8b-shape", Path(tokenizer))
             if on_gpu else target)
    return {"target": target, "draft": draft, "shape": shape, "tag": gpu_models.TINY_TAG,
            "vocab": gpu_models.tokenizer_vocab_size(Path(tokenizer))}


def _run_job(job: dict, out: Path, run_index: int, timeout_s: float) -> dict:
    """One child process; its log is appended to <out>/jobs.log (one file: the device
    sandbox brings back few files)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        partial = Path(tmp) / "partial.json"
        job_path.write_text(json.dumps({**job, "partial_path": str(partial)}))
        log_path = Path(tmp) / "log"
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "vllm_triforce.bench.gpu_job", str(job_path),
                     str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                    timeout=timeout_s, env=dict(os.environ))
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        text = log_path.read_text(errors="replace")
        mirror = os.environ.get("VLLM_TRIFORCE_GPU_MIRROR")
        for folder in (out, Path(mirror) if mirror else None):
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / "jobs.log", "a") as all_logs:
                    all_logs.write(f"\n===== {job['name']} (exit {code}, "
                                   f"{time.monotonic() - start:.0f} s) =====\n"
                                   f"{text[-200_000:]}")
        entry = {"status": "ok" if code == 0 and result_path.exists() else "failed",
                 "seconds": round(time.monotonic() - start, 1), "run": run_index,
                 "model_tag": job.get("model_tag")}
        if entry["status"] == "ok":
            entry["result"] = json.loads(result_path.read_text())
        else:
            entry["error"] = f"exit {code}: " + "\n".join(text.splitlines()[-25:])
            if partial.exists():
                entry["partial"] = json.loads(partial.read_text())
    print(f"bench gpu: {job['name']}: {entry['status']} in {entry['seconds']} s",
          file=sys.stderr, flush=True)
    return entry


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


def _environment() -> dict:
    import torch

    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "cpu": _cpu_model(), "commit": _commit()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for name in ("vllm", "triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _commit() -> str | None:
    if os.environ.get("VLLM_TRIFORCE_COMMIT"):  # scripts/gpu_run.sh: a checkout without .git
        return os.environ["VLLM_TRIFORCE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


# ------------------------------------------------------------------------ summary

def summarise(results: dict) -> dict:
    jobs = results.get("jobs", {})
    return {"exactness": _exactness(jobs), "syncs": _syncs(jobs), "memory": _memory(jobs),
            "costs": _costs(jobs)}


def _ok(jobs: dict, name: str) -> dict | None:
    job = jobs.get(name)
    return job["result"] if job and job["status"] == "ok" else None


def _exactness(jobs: dict) -> list[dict]:
    rows = []
    for name, job in jobs.items():
        if not name.startswith("exact-") or name.endswith("-plain") or job["status"] != "ok":
            continue
        ref = _ok(jobs, name.rsplit("-", 1)[0] + "-plain")
        if ref is None:
            continue
        res, stats = job["result"], job["result"].get("stats", {})
        row = {"job": name, "backend": res["facts"].get("attention_backend"),
               "drafted": stats.get("top_proposed", 0), "accepted": stats.get("top_accepted", 0),
               "middle_drafted": stats.get("middle_proposed", 0),
               "middle_accepted": stats.get("middle_accepted", 0)}
        row.update(compare_tokens(ref["tokens"], res["tokens"], ref.get("margins")))
        rows.append(row)
    return rows


def compare_tokens(ref: list[list[int]], got: list[list[int]],
                   margins: list[list[float]] | None) -> dict:
    """Identical sequences, or, per diverging sequence, the first divergence and plain
    vLLM's top-2 margin there; `explained` when every such margin is below MARGIN_EPS."""
    divergences = []
    for i, (a, b) in enumerate(zip(ref, got)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) == len(b):
            continue
        at = min(len(a), len(b)) if at is None else at
        margin = margins[i][at] if margins and at < len(margins[i]) else None
        divergences.append({"sequence": i, "position": at, "plain_margin": margin})
    explained = all(d["plain_margin"] is not None and d["plain_margin"] < MARGIN_EPS
                    for d in divergences)
    return {"identical": not divergences, "divergences": divergences,
            "explained": explained, "sequences": len(ref)}


def _syncs(jobs: dict) -> list[dict]:
    rows = []
    for name, job in jobs.items():
        if not name.startswith("exact-") or job["status"] != "ok":
            continue
        res = job["result"]
        row = {"job": name, "steps": res.get("steps")}
        if "cuda_syncs" in res:
            row.update(syncs_per_step(res["cuda_syncs"]))
        if "propose_syncs" in res:
            p = res["propose_syncs"]
            row.update({"propose_max_step": p["max_step"], "propose_max_round": p["max_round"],
                        "propose_mean_round": p["mean_round"]})
        rows.append(row)
    return rows


def _cost_result(jobs: dict, name: str) -> dict | None:
    """A cost job's results, finished or partial, compiled or (fallback) eager."""
    for candidate in (name, name + "-eager"):
        job = jobs.get(candidate) or {}
        found = job.get("result") or job.get("partial")
        if found:
            return found
    return None


def syncs_per_step(cuda_syncs: dict) -> dict:
    """vLLM's and TriForce's syncs per step from the recorded sites (gpu_job.sync_owner).
    Runs before sites carried their folder recorded the innermost frame as "vllm
    warnings.py:110" or "triforce cpu_seed.py:64": the owner word is dropped and the
    site re-judged by the same rule."""
    from vllm_triforce.bench.gpu_job import sync_owner

    sites = cuda_syncs.get("sites") or cuda_syncs.get("top_sites", {})
    owners = {"vllm": 0, "triforce": 0}
    for site, hits in sites.items():
        legacy = site.split(" ", 1)
        if len(legacy) == 2 and legacy[0] in owners:
            site = "vllm" if legacy[0] == "vllm" else legacy[1]
        owners[sync_owner(site)] += hits
    steps = max(cuda_syncs.get("steps") or 0, 1)
    return {"vllm_per_step": owners["vllm"] / steps,
            "triforce_per_step": owners["triforce"] / steps}


def _memory(jobs: dict) -> dict | None:
    tri, plain = _cost_result(jobs, "costs-triforce"), _cost_result(jobs, "costs-plain-forced")
    if tri is None:
        return None
    out = dict(tri.get("memory") or {})
    out["many_requests"] = tri.get("many_requests")
    facts = tri.get("facts", {})
    if plain is not None and "facts" in plain and facts:
        block_bytes = facts.get("kv_bytes_per_block")
        out["kv_blocks_triforce"] = facts["num_gpu_blocks"]
        out["kv_blocks_plain"] = plain["facts"]["num_gpu_blocks"]
        if block_bytes:
            out["kv_bytes_given_up"] = (plain["facts"]["num_gpu_blocks"]
                                        - facts["num_gpu_blocks"]) * block_bytes
    return out


def _costs(jobs: dict) -> list[dict]:
    tri = _cost_result(jobs, "costs-triforce")
    defaults = _cost_result(jobs, "costs-plain-defaults")
    forced = _cost_result(jobs, "costs-plain-forced")
    names = []
    for res in (tri, forced, defaults):
        for case in (res or {}).get("cases", {}):
            if case not in names:
                names.append(case)
    rows = []
    for case in names:
        row = {"case": case}
        plain_d = ((defaults or {}).get("cases", {}).get(case) or {}).get("step_ms")
        plain_f = ((forced or {}).get("cases", {}).get(case) or {}).get("step_ms")
        row.update(plain_defaults_ms=plain_d, plain_forced_ms=plain_f,
                   tax=(plain_f / plain_d - 1.0) if plain_d and plain_f else None)
        depths = ((tri or {}).get("cases", {}).get(case) or {}).get("depths", {})
        row["depths"] = depths
        reference = plain_d or plain_f
        if depths and reference:
            row["model"] = {str(a): best_speedup(depths, reference, a) for a in ALPHAS}
            row["measured"] = {k: d["tokens_per_step"] / d["step_ms"] * reference
                               for k, d in depths.items() if d.get("step_ms")}
        rows.append(row)
    return rows


def best_speedup(depths: dict, plain_ms: float, alpha: float) -> dict:
    """The cost model at per-token acceptance `alpha`: depth k emits (1 - alpha^(k+1)) /
    (1 - alpha) tokens per step in the time measured at forced depth k; speedup over a plain
    step of `plain_ms`. Returns the best depth and its speedup."""
    best = {"depth": 0, "speedup": None}
    for k, row in depths.items():
        k = int(k)
        if not row.get("step_ms"):
            continue
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        speedup = tokens * plain_ms / row["step_ms"]
        if best["speedup"] is None or speedup > best["speedup"]:
            best = {"depth": k, "speedup": speedup}
    return best


# ------------------------------------------------------------------------- render

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
              "| case | plain, vLLM defaults | plain, TriForce's settings | tax | depth: step ms "
              "(middle round ms, tokens/step) | model speedup at 0.8 / 0.9 |",
              "|---|---|---|---|---|---|"]
    for r in summary["costs"]:
        ds = "; ".join(f"{k}: {_f(d.get('step_ms'))} ({_f(d.get('middle_round_ms'))}, "
                       f"{_f(d.get('tokens_per_step'))})" for k, d in r["depths"].items())
        model = r.get("model", {})
        sp = " / ".join(f"{_f(model[a]['speedup'])}x (k={model[a]['depth']})"
                        for a in model) or "-"
        lines.append(f"| {r['case']} | {_f(r['plain_defaults_ms'])} | {_f(r['plain_forced_ms'])}"
                     f" | {_pct(r['tax'])} | {ds or '-'} | {sp} |")
    return "\n".join(lines) + "\n"


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _mib(key: str, value) -> str:
    if key.endswith("bytes") or key.endswith("given_up") or key.startswith("max_reserved"):
        return f"{value / 2**20:.1f} MiB" if isinstance(value, (int, float)) else str(value)
    return json.dumps(value) if isinstance(value, dict) else str(value)
