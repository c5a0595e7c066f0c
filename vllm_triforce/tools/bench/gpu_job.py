"""One engine of `vllm-triforce bench gpu` (bench/gpu_check.py), in its own process.

    python -m vllm_triforce.tools.bench.gpu_job JOB.json RESULT.json

JOB.json: {"kind": "kernels" | "generate" | "costs", "model": DIR, "llm": {LLM kwargs},
"spec": speculative_config or null, ...kind's fields}. The engine runs in this process
(vllm_triforce/offline.py), so its runner, the TriForce proposer and the CUDA allocator are
in reach:

* kernels: vLLM's compiled kernels on this torch (RMSNorm from `_C_stable_libtorch`,
  FlashAttention 3) against torch references; no engine.
* generate: greedy outputs (and the top-2 log-prob margin at every position with
  `logprobs`), TriForce's counters, and the syncs per step and per middle round.
* costs: per case (batch x context) the milliseconds of a decode step, and for TriForce of
  a step at each forced depth (middle rounds and verification apart), plus TriForce's
  memory against its reservation.

Syncs on CUDA are counted twice, differently: `torch.cuda.set_sync_debug_mode("warn")`
makes every synchronising CUDA call warn; each warning's Python stack says whose it is
(a frame in vllm_triforce: TriForce's, else vLLM's), divided by the steps vLLM ran. The
project's `SyncCounter` (vllm_triforce/tools/bench/syncs.py) counts inside `propose`, per
middle round.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from vllm_triforce.offline import in_process_llm, runner_of
from vllm_triforce.tools.bench.step_timing import decode_step

ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PACKAGE = str(Path(__file__).resolve().parents[2])  # vllm_triforce/


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    for key, value in {**ENGINE_ENV, **job.get("env", {})}.items():
        os.environ[key] = value
    result = {"kernels": run_kernels, "generate": run_generate, "costs": run_costs}[
        job["kind"]](job)
    Path(result_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------ kernels

def run_kernels(job: dict) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return {**out, "skipped": "no CUDA device"}
    out["gpu"] = torch.cuda.get_device_name()
    out["rms_norm"] = _check(lambda: _rms_norm_error(torch))
    out["flash_attn_3"] = _check(lambda: _fa3_error(torch))
    return out


def _check(fn) -> dict:
    try:
        return {"ok": True, "max_error": fn()}
    except Exception as err:  # a kernel that does not load or run: reported, not raised
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}


def _rms_norm_error(torch) -> float:
    from vllm import _custom_ops as ops

    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.float()
    return float((out.float() - ref).abs().max())


def _fa3_error(torch) -> float:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q = torch.randn(128, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(128, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, 128, cu, 128, cu_seqlens_k=cu, causal=True,
                                 fa_version=3)
    kk, vv = (t.repeat_interleave(4, dim=1).transpose(0, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), kk.float(), vv.float(), is_causal=True).transpose(0, 1)
    return float((out.float() - ref).abs().max())


# ----------------------------------------------------------------------- engines

def build_llm(job: dict):
    return in_process_llm(job["model"], job.get("spec"), disable_log_stats=False, **job["llm"])


def drafter_or_none(llm):
    return getattr(runner_of(llm), "drafter", None) if _is_triforce(llm) else None


def _is_triforce(llm) -> bool:
    return type(getattr(runner_of(llm), "drafter", None)).__name__ == "TriForceProposer"


def engine_facts(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    facts = {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
             "block_size": cfg.cache_config.block_size,
             "runner": type(runner).__module__ + "." + type(runner).__name__,
             "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
             "max_num_seqs": cfg.scheduler_config.max_num_seqs,
             "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens}
    try:
        facts["kv_bytes_per_block"] = sum(
            spec.page_size_bytes for spec in runner.get_kv_cache_spec().values())
    except Exception:  # a runner without get_kv_cache_spec (MRV2)
        pass
    try:
        facts["attention_backend"] = runner.attn_groups[0][0].backend.get_name()
    except Exception:  # MRV2 keeps its groups elsewhere
        facts["attention_backend"] = str(cfg.attention_config.backend)
    drafter = drafter_or_none(llm)
    if drafter is not None:
        facts["reserved_bytes"] = drafter.reserved_bytes
    return facts


def count_steps(llm) -> dict:
    """Counts vLLM's model steps (`execute_model` calls) from now on."""
    runner = runner_of(llm)
    counter = {"steps": 0}
    execute = runner.execute_model

    def counted(*args, **kwargs):
        counter["steps"] += 1
        return execute(*args, **kwargs)

    runner.execute_model = counted
    return counter


class SyncAttribution:
    """Every synchronising CUDA call (torch's sync debug mode), recorded by the innermost
    frame of this package on its Python stack (`engine/forward.py:123`,
    `patches/cpu_seed.py:64`), or `vllm` where there is none. `owner` says whose work it
    is: TriForce's when that frame is the proposer's (engine/, core/) or the sync
    counter's wrapper around it (syncs.py); a patch's frame (patches/) is a thin wrapper
    around vLLM's own method, so a sync under it is vLLM's."""

    def __init__(self):
        self.sites: collections.Counter = collections.Counter()

    def __enter__(self):
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show, warnings.showwarning = warnings.showwarning, self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)
                and "/tools/" not in f.filename]
        if not ours:
            self.sites["vllm"] += 1
            return
        site = ours[-1]
        self.sites[f"{Path(site.filename).relative_to(PACKAGE)}:{site.lineno}"] += 1

    def summary(self, steps: int) -> dict:
        return {"steps": steps, "sites": dict(self.sites.most_common())}


def sync_owner(site: str) -> str:
    """'triforce' or 'vllm' for a site recorded by SyncAttribution (see there). Sites of
    runs before the folder was recorded name the file alone (`cpu_seed.py:64`): a file of
    patches/ is recognised by name."""
    import vllm_triforce.patches as patches

    path = site.rsplit(":", 1)[0]
    in_patches = path.startswith("patches/") or (
        "/" not in path and (Path(patches.__file__).parent / path).exists())
    return "vllm" if path == "vllm" or in_patches else "triforce"


def _prompts(specs: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in specs]


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


# ---------------------------------------------------------------------- generate

def run_generate(job: dict) -> dict:
    import torch
    from vllm import SamplingParams

    llm = build_llm(job)
    drafter = drafter_or_none(llm)
    if drafter is not None and job.get("forced_depths"):
        depth, = job["forced_depths"]  # one fixed depth
        drafter.set_fixed_depth(depth)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=job.get("logprobs"))
    steps = count_steps(llm)
    attribution = SyncAttribution() if torch.cuda.is_available() else None
    attribution_error = None
    propose_syncs = None
    if drafter is not None:
        from vllm_triforce.tools.bench.syncs import ProposeSyncs

        propose_syncs = ProposeSyncs(drafter).__enter__()
    if attribution is not None:
        try:
            attribution.__enter__()
        except Exception as err:  # the counts are a finding, not a reason to lose the tokens
            attribution, attribution_error = None, f"{type(err).__name__}: {err}"
    try:
        outputs = llm.generate(_prompts(job["prompts"]), params, use_tqdm=False)
    finally:
        if attribution is not None:
            attribution.__exit__(None, None, None)
    result = {"facts": engine_facts(llm),
              "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "steps": steps["steps"]}
    if job.get("logprobs"):
        result["margins"] = [_margins(o.outputs[0]) for o in outputs]
    if attribution is not None:
        result["cuda_syncs"] = attribution.summary(steps["steps"])
    elif attribution_error:
        result["cuda_syncs_error"] = attribution_error
    if drafter is not None:
        from vllm_triforce.tools.bench.syncs import summarise

        summary = summarise(propose_syncs.take())
        propose_syncs.__exit__(None, None, None)
        result["propose_syncs"] = {k: summary[k] for k in (
            "max_round", "max_step", "mean_round", "mean_step", "num_rounds", "num_steps",
            "once", "host")}
        result["propose_syncs"]["by_op"] = summary["by_op"]
        result["stats"] = drafter.stats.snapshot()
    return result


def _margins(completion) -> list[float]:
    """Per position, log p(top-1) - log p(top-2) of the engine's own distribution."""
    out = []
    for position in completion.logprobs or []:
        values = sorted((lp.logprob for lp in position.values()), reverse=True)
        out.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return out


# ------------------------------------------------------------------------- costs

def run_costs(job: dict) -> dict:
    import torch

    memory = MemoryProbe() if torch.cuda.is_available() and job.get("spec") else None
    if memory is not None:
        memory.install_init_probe()
    cases = job["cases"]
    start = time.perf_counter()
    llm = build_llm(job)
    result = {"start_s": time.perf_counter() - start, "facts": engine_facts(llm), "cases": {}}
    drafter = drafter_or_none(llm)
    if memory is not None and drafter is not None:
        memory.install_propose_probe(drafter)
    vocab = job["prompt_vocab"]
    for case in cases:
        prompts = random_prompts(case["batch"], case["context"], vocab, seed=case["context"])
        result["cases"][case["name"]] = time_case(llm, drafter, prompts, job)
        _flush(job, result)
    if job.get("many_requests"):
        result["many_requests"] = many_requests(llm, job["many_requests"], vocab)
    if memory is not None and drafter is not None:
        try:
            result["memory"] = memory.report(drafter)
        except Exception as err:
            result["memory"] = {"error": f"{type(err).__name__}: {err}"}
    return result


def _flush(job: dict, result: dict) -> None:
    """Partial results beside the final file, and in the run's mirror folder when it has
    one: a case that completed survives a later crash, and a run killed from outside."""
    for path in (job.get("partial_path"), job.get("partial_mirror")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(result))


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(_prompts(prompts), params, use_tqdm=False)
    return time.perf_counter() - start


def time_case(llm, drafter, prompts, job: dict) -> dict:
    """Prefill once (the prefix cache keeps it), then decode. Plain vLLM and TriForce at
    each forced depth are timed the same way (bench/step_timing.py): a short and a long
    decode in pairs, ms per step from their difference over the extra steps, so
    admission, the prefix-cache hit's recompute and the first selection cancel out. A
    TriForce step's split (proposer / vLLM, ms per middle round, tokens per step,
    acceptance) comes from its counters over the long decodes."""
    short, long = job["decode_tokens"]
    prefill_s = timed_generate(llm, prompts, 1)
    out = {"prefill_s": prefill_s}
    timed_generate(llm, prompts, short)  # warm-up: first decodes after a prefill
    if drafter is None:
        measured = decode_step(lambda m: (timed_generate(llm, prompts, m), m), short, long,
                               repeats=job.get("repeats", 2))
        out["step_ms"] = _ms(measured["step_s"])
        out["timing"] = measured
        return out
    out["depths"] = {}
    for depth in job["depths"]:
        drafter.set_fixed_depth(depth)
        timed_generate(llm, prompts, short)  # warm-up at this depth
        counted = []

        def timed(m: int) -> tuple[float, int]:
            before = drafter.stats.snapshot()
            wall = timed_generate(llm, prompts, m)
            after = drafter.stats.snapshot()
            counted.append((m, wall, before, after))
            return wall, after["plain_steps"] + after["drafting_steps"] - (
                before["plain_steps"] + before["drafting_steps"])

        measured = decode_step(timed, short, long, repeats=job.get("repeats", 2))
        m, wall, before, after = max(counted, key=lambda c: c[0])  # the last long decode
        row = depth_row(before, after, wall, m - 1, len(prompts))
        row["step_ms"] = _ms(measured["step_s"])
        row["timing"] = measured
        out["depths"][str(depth)] = row
    drafter.set_fixed_depth(None)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def depth_row(before: dict, after: dict, wall: float, tokens: int, batch: int) -> dict:
    """One forced depth's decode of `tokens` new tokens per request after the first (which
    the prefix-cache hit's step emits) for `batch` requests: steps (plain + drafting), of
    each step the middle rounds (the proposer's wall time) and the rest (vLLM's step:
    verification of 1 + k tokens per request); ms per middle round; tokens per step per
    request (a plain step's is 1); acceptance. `step_ms` (time_case) replaces this call's
    wall time per step, which includes its admission, with the difference of two decodes."""
    d = {k: after[k] - before[k] for k in ("plain_steps", "drafting_steps", "middle_rounds",
                                           "middle_seconds", "forward_seconds", "top_proposed",
                                           "top_accepted")}
    steps = max(d["plain_steps"] + d["drafting_steps"], 1)
    return {"steps": steps, "wall_s": wall, "wall_ms_per_step": 1000.0 * wall / steps,
            "proposer_ms_per_step": 1000.0 * d["middle_seconds"] / steps,
            "vllm_ms_per_step": 1000.0 * (wall - d["middle_seconds"]) / steps,
            "middle_round_ms": (1000.0 * d["middle_seconds"] / d["middle_rounds"]
                                if d["middle_rounds"] else None),
            "forward_ms_per_round": (1000.0 * d["forward_seconds"] / d["middle_rounds"]
                                     if d["middle_rounds"] else None),
            "rounds_per_step": d["middle_rounds"] / steps,
            "tokens": tokens, "tokens_per_step": tokens / steps,
            "batch": batch,
            "acceptance": (d["top_accepted"] / d["top_proposed"] if d["top_proposed"]
                           else None)}


def many_requests(llm, spec: dict, vocab: int) -> dict:
    """`num` requests at once (more than the 32 that draft in a step): no OOM, every
    request completes."""
    prompts = random_prompts(spec["num"], spec["context"], vocab, seed=7)
    try:
        wall = timed_generate(llm, prompts, spec["tokens"])
        return {"ok": True, "num": spec["num"], "context": spec["context"], "wall_s": wall}
    except Exception as err:  # an OOM here is the finding
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}


class MemoryProbe:
    """TriForce's own CUDA allocations: what `initialize_attn_backend` keeps (summaries,
    hand-off buffer) and the peak above the allocator's level at entry of each `propose`
    (selection scratch, probabilities, middle passes' activations); against
    `reserved_bytes`, what the proposer took out of vLLM's KV budget."""

    def __init__(self):
        self.persistent = 0
        self.propose_peak = 0
        self.calls = 0

    def install_init_probe(self) -> None:
        import torch

        from vllm_triforce.engine.proposer import TriForceProposer

        original = TriForceProposer.initialize_attn_backend
        probe = self

        def measured(proposer, *args, **kwargs):
            before = torch.cuda.memory_allocated()
            original(proposer, *args, **kwargs)
            probe.persistent = torch.cuda.memory_allocated() - before

        TriForceProposer.initialize_attn_backend = measured

    def install_propose_probe(self, drafter) -> None:
        import torch

        propose = drafter.propose

        def measured(*args, **kwargs):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                return propose(*args, **kwargs)
            finally:
                self.calls += 1
                self.propose_peak = max(self.propose_peak,
                                        torch.cuda.max_memory_allocated() - base)

        drafter.propose = measured

    def report(self, drafter) -> dict:
        import torch

        free, total = torch.cuda.mem_get_info()
        return {"reserved_bytes": drafter.reserved_bytes, "persistent_bytes": self.persistent,
                "propose_peak_bytes": self.propose_peak, "propose_calls": self.calls,
                "within_reservation": self.persistent + self.propose_peak
                <= drafter.reserved_bytes,
                "device_free_bytes": free, "device_total_bytes": total,
                "max_reserved_by_torch": torch.cuda.max_memory_reserved()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
