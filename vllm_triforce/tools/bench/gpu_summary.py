"""What `vllm-triforce bench gpu` (bench/gpu_check.py) concludes from its jobs' results: the
summary in results.json -- exactness (token identity, or divergences explained by plain
vLLM's near-ties), sampled output against plain vLLM's distribution, syncs per step by
owner, memory against the reservation, and per cost case the plain steps, the tax of
TriForce's settings and a projection of the speedup.

The projection is what it says: the GPU measures each depth's step at the 8B shape with
random weights (which accept everything a constant output allows, so their acceptance
says nothing), and the acceptance of real text at the same budget-to-context ratio comes
from the CPU's teacher-forced bench (`bench acceptance`, results["acceptance"]).
"""

from __future__ import annotations

import math

MARGIN_EPS = 0.05  # nats: a bf16 divergence is explained when plain's top-2 margin is below
# The sampled jobs' chi-square bar (tests/test_triforce_sampling.py's): fixed seeds make each
# outcome deterministic; ALPHA only sets where "differs" begins.
ALPHA = 1e-3
PROJECTION = "projected from GPU step costs and CPU-measured acceptance"


def summarise(results: dict) -> dict:
    jobs = results.get("jobs", {})
    return {"exactness": _exactness(jobs), "stale": _stale(jobs),
            "distribution": _distribution(jobs),
            "syncs": _syncs(jobs), "memory": _memory(jobs),
            "costs": _costs(jobs, results.get("acceptance")), "tax": _tax(jobs)}


def _ok(jobs: dict, name: str) -> dict | None:
    job = jobs.get(name)
    return job["result"] if job and job["status"] == "ok" else None


def _reference_name(name: str, job: dict) -> str:
    return job["result"].get("reference") or name.rsplit("-", 1)[0] + "-plain"


def _same_models(jobs: dict, name: str) -> bool:
    """Whether a job ran the models its reference ran (`model_tag`: a later run that
    rebuilt the models by another recipe redoes the reference first)."""
    ref = jobs.get(_reference_name(name, jobs[name]), {})
    return jobs[name].get("model_tag") == ref.get("model_tag")


def _compared_rows(jobs: dict, prefix: str) -> list[str]:
    """The TriForce jobs of `prefix` ("exact-", "sample-") that ran, with a reference that
    ran, on the same models (else `_stale`)."""
    return [name for name in _judged_rows(jobs, prefix) if _same_models(jobs, name)]


def _judged_rows(jobs: dict, prefix: str) -> list[str]:
    return [name for name, job in jobs.items() if name.startswith(prefix)
            and not name.endswith("-plain") and job["status"] == "ok"
            and _ok(jobs, _reference_name(name, job)) is not None]


def _stale(jobs: dict) -> list[str]:
    """Exactness and sampled jobs left uncompared: their reference was run again on other
    models."""
    return [name for prefix in ("exact-", "sample-") for name in _judged_rows(jobs, prefix)
            if not _same_models(jobs, name)]


def _exactness(jobs: dict) -> list[dict]:
    rows = []
    for name in _compared_rows(jobs, "exact-"):
        job = jobs[name]
        ref = _ok(jobs, _reference_name(name, job))
        res, stats = job["result"], job["result"].get("stats", {})
        row = {"job": name, "backend": res["facts"].get("attention_backend"),
               "drafted": stats.get("top_proposed", 0), "accepted": stats.get("top_accepted", 0),
               "middle_drafted": stats.get("middle_proposed", 0),
               "middle_accepted": stats.get("middle_accepted", 0),
               "host_plain_steps": stats.get("host_plain_steps", 0)}
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


def _distribution(jobs: dict) -> list[dict]:
    """Per sampled TriForce job (`sample-*`, bench/gpu_plan.py `_sample_jobs`): the p-value
    of its tokens 2.. (drafted; token 1 comes from the prefill) having plain vLLM's
    distribution, position by position, and a verdict. A job of the right hand-off passes
    with every p above ALPHA; a negative control (`wrong_temperature`) must be caught
    (some p below ALPHA), or the check has no power on this model and the passes beside
    it prove nothing. Drafted counts say whether drafting happened at all."""
    rows = []
    for name in _compared_rows(jobs, "sample-"):
        job = jobs[name]
        ref = _ok(jobs, _reference_name(name, job))
        res, stats = job["result"], job["result"].get("stats", {})
        pvalues = [homogeneity_pvalue(a, b) for a, b in
                   zip(ref["samples"][1:], res["samples"][1:])]
        known = [p for p in pvalues if p is not None]
        wrong = res.get("wrong_temperature") is not None
        low = bool(known) and min(known) < ALPHA
        if not known:
            verdict = "no p-value (scipy missing)"
        elif stats.get("top_proposed", 0) == 0:
            verdict = "nothing drafted: proves nothing"
        elif wrong:
            verdict = "caught" if low else "NOT caught: the check has no power here"
        else:
            verdict = "differs" if low else "same distribution"
        rows.append({"job": name, "wrong_temperature": res.get("wrong_temperature"),
                     "samples": res["sampling"]["copies"],
                     "drafted": stats.get("top_proposed", 0),
                     "accepted": stats.get("top_accepted", 0),
                     "depth_counts": stats.get("depth_counts"),
                     "pvalues": pvalues, "verdict": verdict,
                     "runner": res["facts"].get("runner"),
                     "async_scheduling": res["facts"].get("async_scheduling")})
    return rows


def homogeneity_pvalue(a: dict, b: dict) -> float | None:
    """Two-sample chi-square on token counts ({token: count} each), tokens seen fewer than
    10 times in both together pooled into one cell; None without scipy."""
    try:
        from scipy.stats import chi2_contingency
    except ImportError:
        return None
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    rows, other = [], [0, 0]
    for k in keys:
        pair = [a.get(k, 0), b.get(k, 0)]
        if sum(pair) >= 10:
            rows.append(pair)
        else:
            other = [other[0] + pair[0], other[1] + pair[1]]
    if sum(other) > 0:
        rows.append(other)
    if len(rows) < 2:  # one token only, in both: nothing to tell apart
        return 1.0
    return float(chi2_contingency(rows)[1])


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


# A cost job that failed compiled runs again without AOT compile, then eager
# (bench/gpu_check.py): the suffix of its name, and what its numbers are.
FALLBACKS = (("", "compiled"), ("-noaot", "compiled without AOT compile"),
             ("-eager", "eager (compiled engine failed)"))


def _cost_result(jobs: dict, name: str) -> dict | None:
    """A cost job's results, finished or partial, compiled or after a fallback, each case
    from the first of FALLBACKS that measured it; "engine" says which, for the job (its
    first result) and for each case."""
    merged = None
    for suffix, mode in FALLBACKS:
        job = jobs.get(name + suffix) or {}
        found = job.get("result") or job.get("partial")
        if not found:
            continue
        cases = {case: {**row, "engine": mode} for case, row in found.get("cases", {}).items()}
        if merged is None:
            merged = {**found, "engine": mode, "cases": cases}
        else:
            merged["cases"] = {**cases, **merged["cases"]}
    return merged


def syncs_per_step(cuda_syncs: dict) -> dict:
    """vLLM's and TriForce's syncs per step from the recorded sites (gpu_job.sync_owner).
    Runs before sites carried their folder recorded the innermost frame as "vllm
    warnings.py:110" or "triforce cpu_seed.py:64": the owner word is dropped and the
    site re-judged by the same rule."""
    from vllm_triforce.tools.bench.gpu_job import sync_owner

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
    kept = _cost_result(jobs, "kv-kept")  # compact, no prefill peak, at 0.9
    if kept is not None and "facts" in kept:
        out["kv_kept"] = {**(kept.get("memory") or {}),
                          "kv_blocks": kept["facts"]["num_gpu_blocks"],
                          "gpu_memory_utilization": kept["facts"].get("gpu_memory_utilization")}
        # plain vLLM at kv-kept's settings where it ran (kv-plain), else at the cost
        # cases' (a smaller max_num_seqs: named beside the ratio)
        same = _cost_result(jobs, "kv-plain")
        reference = same if same is not None and "facts" in same else plain
        if reference is not None and "facts" in reference:
            out["kv_kept"]["of_plain"] = (kept["facts"]["num_gpu_blocks"]
                                          / reference["facts"]["num_gpu_blocks"])
            out["kv_kept"]["plain_blocks"] = reference["facts"]["num_gpu_blocks"]
            out["kv_kept"]["plain_max_num_seqs"] = reference["facts"].get("max_num_seqs")
    return out


def _costs(jobs: dict, acceptance: dict | None = None) -> list[dict]:
    tri = _cost_result(jobs, "costs-triforce")
    defaults = _cost_result(jobs, "costs-plain-defaults")
    forced = _cost_result(jobs, "costs-plain-forced")
    mrv2 = _cost_result(jobs, "costs-triforce-mrv2")
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
        modes = {key: ((res or {}).get("cases", {}).get(case) or {}).get("engine")
                 for key, res in (("plain_defaults", defaults), ("plain_forced", forced),
                                  ("triforce", tri))}
        # the tax compares like with like: both compiled (AOT compile or not: the same
        # graphs), or both eager
        same_mode = _graphs(modes["plain_defaults"]) == _graphs(modes["plain_forced"])
        row.update(plain_defaults_ms=plain_d, plain_forced_ms=plain_f, engines=modes,
                   tax=(plain_f / plain_d - 1.0) if plain_d and plain_f and same_mode
                   else None)
        depths = ((tri or {}).get("cases", {}).get(case) or {}).get("depths", {})
        row["depths"] = depths
        # a speedup is only ever taken against vLLM's defaults without saying otherwise
        row["reference"] = ("vLLM defaults" if plain_d else
                            "plain vLLM with TriForce's settings (vLLM defaults not measured)"
                            if plain_f else None)
        if depths and plain_d and acceptance:
            row["projection"] = project(case, depths, plain_d, acceptance)
        # TriForce on vLLM's defaults (MRV2, FULL decode graphs, async): its depth-0 step
        # against plain vLLM's defaults' is issue 60's number
        on_v2 = ((mrv2 or {}).get("cases", {}).get(case) or {}).get("depths", {})
        if on_v2:
            row["mrv2_depths"] = on_v2
            depth0 = (on_v2.get("0") or on_v2.get(0) or {}).get("step_ms")
            row["mrv2_depth0_of_defaults"] = depth0 / plain_d if depth0 and plain_d else None
        rows.append(row)
    return rows


# issue 60's tax split (bench/gpu_plan.py TAX_SETTINGS, TAX_SPEC), from vLLM's defaults
# toward TriForce's settings one setting at a time, then all three (TriForce's), then a
# spec-decode engine's (1 + K)-token FULL step. Each end is taken from the split's own run
# (same card, same graphs) where it has one, else from the cost jobs.
TAX_ENDS = {"defaults": ("tax-defaults", "costs-plain-defaults"),
            "forced": ("tax-forced", "costs-plain-forced")}
TAX_ROWS = (("tax-v2-full-sync", "V2, FULL_AND_PIECEWISE, sync"),
            ("tax-v2-piecewise-sync", "V2, PIECEWISE, sync"),
            ("tax-v1-full-async", "V1, FULL_AND_PIECEWISE, async"),
            ("forced", "V1, PIECEWISE, sync (TriForce's settings)"),
            ("tax-spec-filler", "n-gram spec decode, 1 + K tokens a step, FULL"))


def _tax(jobs: dict) -> list[dict]:
    """Per case, plain vLLM's ms per step with vLLM's defaults and with each setting of
    TAX_ROWS, each over the defaults' step where both ran compiled (or both eager); the
    spec-decode engine's draft tokens per request-step and acceptance, and TriForce's
    depth 0 on Model Runner V2 beside them. `reference`: the job the defaults came from."""
    if not any(name.startswith("tax-") and _cost_result(jobs, name) for name in jobs):
        return []
    mrv2 = _cost_result(jobs, "costs-triforce-mrv2") or {}
    found = {name: _cost_result(jobs, name) for name, _ in TAX_ROWS if name not in TAX_ENDS}
    names = []
    for res in found.values():
        names += [c for c in (res or {}).get("cases", {}) if c not in names]
    rows = []
    for case in names:
        ends = {end: _tax_end(jobs, case, candidates) for end, candidates in TAX_ENDS.items()}
        ref_job, ref = ends["defaults"]
        row = {"case": case, "defaults_ms": ref.get("step_ms"), "reference": ref_job,
               "settings": []}
        for name, label in TAX_ROWS:
            job, got = ends[name] if name in ends else (
                name, ((found.get(name) or {}).get("cases", {}).get(case)) or {})
            if got.get("step_ms") is None:
                continue
            like = _graphs(got.get("engine")) == _graphs(ref.get("engine"))
            entry = {"job": job, "label": label, "step_ms": got["step_ms"],
                     "of_defaults": (got["step_ms"] / ref["step_ms"]
                                     if like and ref.get("step_ms") else None)}
            if "draft_tokens_per_draft" in got:
                entry.update(draft_tokens_per_draft=got["draft_tokens_per_draft"],
                             acceptance=got.get("acceptance"))
            row["settings"].append(entry)
        depth0 = (((mrv2.get("cases", {}).get(case) or {}).get("depths") or {}).get("0")
                  or {}).get("step_ms")
        row["mrv2_depth0_ms"] = depth0
        rows.append(row)
    return rows


def _tax_end(jobs: dict, case: str, candidates: tuple[str, ...]) -> tuple[str | None, dict]:
    """(job, its row of `case`) of the first of `candidates` that measured the case."""
    for name in candidates:
        got = ((_cost_result(jobs, name) or {}).get("cases", {}).get(case)) or {}
        if got.get("step_ms") is not None:
            return name, got
    return None, {}


def _graphs(mode: str | None) -> bool | None:
    return None if mode is None else not mode.startswith("eager")


def project(case: str, depths: dict, plain_ms: float, acceptance: dict) -> dict:
    """The speedup over plain vLLM's defaults at the best depth, with the per-token
    acceptance measured on real text (`acceptance["points"]`: context, budget, acceptance)
    at the budget-to-context ratio nearest this case's (gpu_plan's budget and context)."""
    from vllm_triforce.tools.bench.gpu_plan import COST_SPEC, CPU_CASES, GPU_CASES

    context = next(c for name, _, c in GPU_CASES + CPU_CASES if name == case)
    ratio = COST_SPEC["retrieval_budget"] / context
    point = min(acceptance["points"],
                key=lambda p: abs(math.log(p["budget"] / p["context"] / ratio)))
    best = best_speedup(depths, plain_ms, point["acceptance"])
    return {**best, "acceptance": point["acceptance"], "label": PROJECTION,
            "case_ratio": ratio, "measured_at": {k: point[k] for k in ("context", "budget")},
            "source": acceptance.get("source")}


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
