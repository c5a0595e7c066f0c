"""One benchmark process: build engines for a list of runs, time them, write JSON.

    python -m vllm_triforce.tools.bench.worker JOB.json RESULT.json [REPLY_FD]

With REPLY_FD the job's one run stays live and takes turns: commands on stdin, replies on
that file descriptor (`serve_turns`; bench/runner.py `run_interleaved`).

JOB.json: {"model": DIR, "prompts": [[token ids], ...], "max_tokens": M,
"repeats": R, "temperature": T, "top_p": P, "dtype": "auto", "max_model_len": L,
"block_size": 32, "runs": [{"name": str, "spec": speculative_config or null,
optional "temperature", "block_size", "prompts", "variants", "engine" (more `LLM`
keywords)}, ...]}.
RESULT.json: a list with one dict per run (same order; a run's variants follow it):
tokens, prefill_s, decode_s (one per repeat of every turn), round_decode_s (each turn's
median), and for spec runs vLLM's spec-decode
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
    _engine_env()
    # ngram last: a later engine in this process would fail (module docstring).
    order = sorted(range(len(job["runs"])), key=lambda i: _is_ngram(job["runs"][i]))
    results: list[list[dict] | None] = [None] * len(job["runs"])
    for i in order:
        results[i] = run_one(job, job["runs"][i])
    return [r for group in results for r in group]


def _engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def _is_ngram(run: dict) -> bool:
    return bool(run.get("spec")) and run["spec"].get("method") == "ngram"


def run_one(job: dict, run: dict) -> list[dict]:
    """The run's result, then one per entry of `run["variants"]` ({"name", "forced"}): the
    same TriForce engine timed again at a fixed depth (`forced`: [k], the proposer's
    `set_fixed_depth(k)`), so fixed depths and the controller are compared on one engine,
    one prefill."""
    engine = RunEngine(job, run)
    for row in range(len(engine.rows)):
        engine.turn(row)
    return engine.results()


def serve_turns(job: dict, commands, replies) -> list[dict]:
    """The job's one run as a live engine whose rows are timed when the parent says so
    (bench/runner.py `run_interleaved`): `ready N` (N rows) once the engine is prefilled
    and warmed up, then for each `turn ROW` read from `commands` one turn of that row and
    `done`; `end` (or the end of `commands`) finishes with the rows' results."""
    _engine_env()
    run, = job["runs"]
    engine = RunEngine(job, run)
    replies.write(f"ready {len(engine.rows)}\n")
    for line in commands:
        word, *rest = line.split()
        if word == "end":
            break
        engine.turn(int(rest[0]))
        replies.write("done\n")
    return engine.results()


class RunEngine:
    """One run's engine, prefilled and given an untimed warm-up decode, and its rows: the
    run itself, then each of its variants (the same TriForce engine at a fixed depth).
    `turn(row)` times `repeats` generations of a row; `results()` gives each row's result
    over its turns (decode times of every turn, `round_decode_s` their medians turn by
    turn), counts syncs, calibrates where asked, and frees the engine."""

    def __init__(self, job: dict, run: dict):
        from vllm import SamplingParams

        from vllm_triforce.tools.cpu_openmp import runtime_in_use

        self.job, self.run, self.spec = job, run, run.get("spec")
        llm = in_process_llm(job["model"], self.spec, dtype=job.get("dtype", "auto"),
                             enforce_eager=True,
                             block_size=run.get("block_size", job.get("block_size", 32)),
                             seed=job.get("seed", 0), max_model_len=job["max_model_len"],
                             disable_log_stats=False, enable_prefix_caching=True,
                             **run.get("engine", {}))
        self.llm = llm
        self.prompts = [{"prompt_token_ids": ids} for ids in run.get("prompts", job["prompts"])]
        temperature = run.get("temperature", job.get("temperature", 0.0))
        self.params = SamplingParams(temperature=temperature, top_p=job.get("top_p", 1.0),
                                     max_tokens=job["max_tokens"], ignore_eos=True, seed=None)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        # Prefill alone (1 new token); the timed runs then hit the prefix cache.
        start = time.perf_counter()
        llm.generate(self.prompts, first, use_tqdm=False)
        self.prefill_s = time.perf_counter() - start
        # Untimed warm-up decode (first decode steps pay one-off initialisation).
        warm = SamplingParams(temperature=0.0, max_tokens=min(job["max_tokens"], 8),
                              ignore_eos=True)
        llm.generate(self.prompts, warm, use_tqdm=False)
        self.drafter = (drafter_of(llm) if self.spec and self.spec.get("method") == "triforce"
                        else None)
        self.openmp = runtime_in_use()
        self.rows = [{"name": run["name"], "forced": None},
                     *({"name": v["name"], "forced": v["forced"]}
                       for v in run.get("variants", []))]
        self.turns: list[list[dict]] = [[] for _ in self.rows]

    def turn(self, row: int) -> None:
        """`repeats` timed generations of row `row`, its depth set first (a variant's fixed
        one; the run's own: the configured behaviour)."""
        self._set_depth(row)
        self.turns[row].append(_timed(self.llm, self.drafter, self.prompts, self.params,
                                      self.job.get("repeats", 1)))

    def _set_depth(self, row: int) -> None:
        if self.drafter is not None:
            forced = self.rows[row]["forced"]
            self.drafter.set_fixed_depth(None if forced is None else forced[0])  # one depth

    def results(self) -> list[dict]:
        results = []
        for row, turns in zip(self.rows, self.turns):
            result = {"name": row["name"], "spec": self.spec, "prefill_s": self.prefill_s,
                      "openmp": self.openmp, **merge_turns(turns)}
            if row["forced"] is not None:
                result["forced"] = row["forced"]
            results.append(result)
        if self.drafter is not None:
            for row, result in enumerate(results):
                self._set_depth(row)
                result["syncs"] = _count_syncs(self.llm, self.drafter, self.prompts,
                                               self.params)
        if self.run.get("calibrate"):
            results[0]["calibration"] = calibrate(
                self.llm, [p["prompt_token_ids"] for p in self.prompts], results[0]["tokens"],
                block_size=self.llm.llm_engine.vllm_config.cache_config.block_size,
                **self.run["calibrate"])
        free_llm(self.llm)
        return results


def merge_turns(turns: list[dict]) -> dict:
    """One row's `_timed` results of its turns as one: `merge_times`, and the counters
    summed."""
    out = {**merge_times(turns), "vllm_spec": _summed([t["vllm_spec"] for t in turns])}
    if "triforce" in turns[0]:
        out["triforce"] = _summed([t["triforce"] for t in turns])
    return out


def merge_times(timings: list[dict]) -> dict:
    """Several timings of one row (turns of one process, or rounds of separate ones:
    bench/speed.py `merge_rounds`) as one: every decode time, each timing's median
    (`round_decode_s`), and the greedy tokens (None where one timing's differ from the
    first's). Example: decode times [2, 3] and [4, 4] give decode_s [2, 3, 4, 4] and
    round_decode_s [2.5, 4]."""
    first = timings[0]["tokens"]
    return {"tokens": first if all(t["tokens"] == first for t in timings) else None,
            "decode_s": [s for t in timings for s in t["decode_s"]],
            "round_decode_s": [statistics.median(t["decode_s"]) for t in timings]}


def _summed(deltas: list[dict]) -> dict:
    """Counter deltas of several turns added up (lists element-wise); the decayed
    tokens-per-second gauges, which are not deltas (`_stat_delta`), as the last turn left
    them."""
    out = dict(deltas[0])
    for delta in deltas[1:]:
        for name, value in delta.items():
            if name.endswith("tokens_per_s") or name not in out:
                out[name] = value
            elif isinstance(value, list):
                mine = out[name]
                out[name] = [(mine[i] if i < len(mine) else 0) + (value[i] if i < len(value)
                                                                    else 0)
                             for i in range(max(len(mine), len(value)))]
            else:
                out[name] = out[name] + value
    return out


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
    if len(argv) > 2:  # a live engine taking turns, replies on file descriptor argv[2]
        with os.fdopen(int(argv[2]), "w", buffering=1) as replies:
            results = serve_turns(job, sys.stdin, replies)
    else:
        results = run_job(job)
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
