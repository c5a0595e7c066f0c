"""One benchmark process: build engines for a list of runs, time them, write JSON.

    python -m vllm_triforce.tools.bench.worker JOB.json RESULT.json

JOB.json: {"model": DIR, "prompts": [[token ids], ...], "max_tokens": M,
"repeats": R, "temperature": T, "top_p": P, "dtype": "auto", "max_model_len": L,
"block_size": 32, "runs": [{"name": str, "spec": speculative_config or null,
optional "temperature", "block_size", "prompts", "variants", "engine" (more `LLM`
keywords)}, ...]}.
RESULT.json: a list with one dict per run (same order; a run's variants follow it):
tokens, prefill_s, decode_s (one per repeat), and for spec runs vLLM's spec-decode
counters (timed runs only) and, for TriForce, the drafter's per-level counters
(`stats.snapshot()`).

The parent (`vllm_triforce.tools.bench.runner`) starts one process per run by default:
memory is returned between methods and an ngram engine cannot spoil the next engine.
(vLLM 0.32 on a CPU: once an ngram engine has loaded numba, building another `LLM` in
the same process fails with `'_lib_fn_wrapper' object has no attribute 'get'`, raised
in vllm/triton_utils/dispatcher.py; in-process ngram also wants
NUMBA_THREADING_LAYER=workqueue, measured 15 -> 1,515 tok/s.) vLLM logs to stdout,
so results go to a file.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from vllm_triforce.offline import drafter_of, free_llm, in_process_llm
from vllm_triforce.tools.bench.step_timing import decode_step

ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
              "NUMBA_THREADING_LAYER": "workqueue",
              # host ms per round = propose time - forward time: forwards device-timed on a GPU
              "VLLM_TRIFORCE_TIME_FORWARDS": "1"}


def run_job(job: dict) -> list[dict]:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    # ngram last: a later engine in this process would fail (module docstring).
    order = sorted(range(len(job["runs"])), key=lambda i: _is_ngram(job["runs"][i]))
    results: list[list[dict] | None] = [None] * len(job["runs"])
    for i in order:
        results[i] = run_one(job, job["runs"][i])
    return [r for group in results for r in group]


def _is_ngram(run: dict) -> bool:
    return bool(run.get("spec")) and run["spec"].get("method") == "ngram"


def run_one(job: dict, run: dict) -> list[dict]:
    """The run's result, then one per entry of `run["variants"]` ({"name", "forced"}): the
    same TriForce engine timed again at a fixed depth (`forced`: [k], the proposer's
    `set_fixed_depth(k)`), so fixed depths and the controller are compared on one engine,
    one prefill."""
    from vllm import SamplingParams

    from vllm_triforce.tools.cpu_openmp import runtime_in_use

    spec = run.get("spec")
    llm = in_process_llm(job["model"], spec, dtype=job.get("dtype", "auto"), enforce_eager=True,
                         block_size=run.get("block_size", job.get("block_size", 32)),
                         seed=job.get("seed", 0), max_model_len=job["max_model_len"],
                         disable_log_stats=False, enable_prefix_caching=True,
                         **run.get("engine", {}))
    prompts = [{"prompt_token_ids": ids} for ids in run.get("prompts", job["prompts"])]
    temperature = run.get("temperature", job.get("temperature", 0.0))
    params = SamplingParams(temperature=temperature, top_p=job.get("top_p", 1.0),
                            max_tokens=job["max_tokens"], ignore_eos=True, seed=None)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Prefill alone (1 new token); the timed runs then hit the prefix cache.
    start = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    # Untimed warm-up decode (first decode steps pay one-off initialisation).
    warm = SamplingParams(temperature=0.0, max_tokens=min(job["max_tokens"], 8), ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    drafter = drafter_of(llm) if spec and spec.get("method") == "triforce" else None
    result = {"name": run["name"], "spec": spec, "prefill_s": prefill_s,
              "openmp": runtime_in_use(),
              **_timed(llm, drafter, prompts, params, job.get("repeats", 1))}
    if drafter is not None:
        result["syncs"] = _count_syncs(llm, drafter, prompts, params)
    if run.get("calibrate"):
        result["calibration"] = calibrate(llm, [p["prompt_token_ids"] for p in prompts],
                                          result["tokens"], block_size=llm.llm_engine
                                          .vllm_config.cache_config.block_size,
                                          **run["calibrate"])
    results = [result]
    for variant in run.get("variants", []):
        depth, = variant["forced"]  # one fixed depth
        drafter.set_fixed_depth(depth)
        results.append({"name": variant["name"], "spec": spec, "prefill_s": prefill_s,
                        "forced": variant["forced"], "openmp": result["openmp"],
                        **_timed(llm, drafter, prompts, params, job.get("repeats", 1)),
                        "syncs": _count_syncs(llm, drafter, prompts, params)})
    free_llm(llm)
    return results


def _count_syncs(llm, drafter, prompts, params, max_tokens: int = 16) -> dict:
    """Device syncs per middle round and per step (vllm_triforce/tools/bench/syncs.py) in one more,
    untimed generation of up to `max_tokens` (counting slows every op down)."""
    from vllm_triforce.tools.bench.syncs import ProposeSyncs, summarise

    short = params.clone()
    short.max_tokens = min(params.max_tokens, max_tokens)
    with ProposeSyncs(drafter) as recorder:
        llm.generate(prompts, short, use_tqdm=False)
    summary = summarise(recorder.take())
    return {k: summary[k] for k in ("max_round", "max_step", "mean_round", "mean_step",
                                    "num_rounds", "num_steps")}


def _timed(llm, drafter, prompts, params, repeats: int) -> dict:
    """Median-able decode times, the last repeat's tokens, and the counters of these
    generations only (vLLM's spec-decode ones and, for TriForce, the drafter's)."""
    before = drafter.stats.snapshot() if drafter else None
    spec_before = spec_metrics(llm)
    decode_s, tokens = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        decode_s.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    out = {"tokens": tokens, "decode_s": decode_s,
           "vllm_spec": counter_delta(spec_metrics(llm), spec_before)}
    if drafter is not None:
        after = drafter.stats.snapshot()
        out["triforce"] = {k: _stat_delta(k, after[k], before[k]) for k in after}
    return out


# The most decode steps one calibration call times (`calibrate`): n = 8, then doubled while
# the steps are lost in the host's noise.
MAX_CALIBRATION_STEPS = 64


def calibrate(llm, prompts: list[list[int]], continuations: list[list[int]], *,
              block_size: int, query_tokens: list[int], contexts: list[int],
              repeats: int = 3) -> dict:
    """Per-step costs of plain vLLM measured in isolation, for the cost model.

    `step_s[k]`: one step in which every request runs k query tokens over its full
    (prefix-cached) prompt -- k = 1 is a decode step, k = gamma + 1 a verification step.
    `context_step_s[c]`: a decode step over only the first c tokens -- the ideal cost of a
    middle-level round over a c-token retrieval cache. Method: a `generate` of m new tokens
    costs overhead + step(first) + (m - 1) * step(1); timing m = 1 and m = 1 + n separates
    the per-call overhead from the steps (bench/step_timing.py, the one way steps are
    timed: paired calls, median of the differences, the long call doubled while the steps
    are lost in the host's noise, up to MAX_CALIBRATION_STEPS; still lost, the long call's
    time per step is taken, an upper bound). Prompts are cut to whole blocks so every prompt token is a
    prefix-cache hit and exactly k tokens are computed. A step over k > 1 query tokens is
    floored at the decode step: the subtraction of the per-call overhead came out negative
    once on a tiny model (CI, -45 ms), and more query tokens never cost less.
    """
    from vllm import SamplingParams

    def timed_once(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return time.perf_counter() - start

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        return statistics.median(timed_once(batch, max_tokens) for _ in range(repeats))

    def decode_and_overhead(batch):
        measured = decode_step(lambda m: (timed_once(batch, m), m), 1, 1 + 8,
                               repeats=repeats, max_long=1 + MAX_CALIBRATION_STEPS)
        if measured["step_s"] is None:  # lost in the host's noise even at the most steps:
            # the long call's time per step, overhead included (an upper bound)
            long = measured["long"]
            return statistics.median(b[0] for _, b in measured["pairs"]) / long, 0.0
        return measured["step_s"], measured["overhead_s"]

    # Whole blocks of prompt + k tokens of the run's own output: the blocks hit the prefix
    # cache and exactly k tokens are computed (a prompt that is all cache hits would
    # recompute its whole last block instead).
    whole = [ids[:len(ids) // block_size * block_size] for ids in prompts]

    def with_queries(k: int) -> list[list[int]]:
        return [ids + cont[:k] for ids, cont in zip(whole, continuations)]

    step_1, overhead = decode_and_overhead(with_queries(1))
    out = {"step_s": {1: step_1}, "overhead_s": overhead, "context_step_s": {}}
    for k in query_tokens:
        if k > 1:  # never below a decode step: on a tiny model the difference is noise-level
            out["step_s"][k] = max(timed(with_queries(k), 1) - overhead, step_1)
    for c in contexts:
        cut = min(max(c // block_size, 1) * block_size, len(whole[0]) - block_size)
        out["context_step_s"][c] = decode_and_overhead([ids[:cut + 1] for ids in whole])[0]
    return out


def _stat_delta(name: str, after, before):
    """Counters of the timed runs: differences (element-wise for the depth histogram);
    the tokens-per-second rates are decayed gauges, taken as they are at the end."""
    if isinstance(after, list):
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    if name.endswith("tokens_per_s"):
        return after
    return after - before


def spec_metrics(llm) -> dict:
    """vLLM's own spec-decode counters now (`vllm:spec_decode_num_*`; stats logging on)."""
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_")}


def counter_delta(after: dict, before: dict) -> dict:
    """Counters of the timed runs only (not prefill or warm-up)."""
    return {k: (v or 0) - (before.get(k) or 0) for k, v in after.items()}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    results = run_job(job)
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
