"""The `costs` job of `vllm-triforce bench gpu` (gpu_job.py runs it): per case (batch x
context) the milliseconds of a decode step of plain vLLM, and of TriForce at each forced
depth with its split (middle rounds, verification), many requests at once, and TriForce's
CUDA memory against its reservation (`MemoryProbe`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from vllm_triforce.tools.bench.gpu_engine import (build_llm, count_steps, drafter_or_none,
                                                   engine_facts, random_prompts, token_prompts)
from vllm_triforce.tools.bench.step_timing import decode_step
from vllm_triforce.tools.bench.worker import counter_delta, spec_metrics


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
    llm.generate(token_prompts(prompts), params, use_tqdm=False)
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
        if job.get("spec"):  # another drafter: steps and drafts counted, not assumed
            return {**out, **_spec_engine_steps(llm, prompts, job)}
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


def _spec_engine_steps(llm, prompts, job: dict) -> dict:
    """A spec-decode engine other than TriForce's, timed as plain vLLM is, but with its
    model steps counted (`execute_model` calls: a step may emit several tokens) and vLLM's
    own spec-decode counters over the decodes: the draft tokens a step verified per
    request, and how many were accepted."""
    short, long = job["decode_tokens"]
    steps = count_steps(llm)
    before = spec_metrics(llm)

    def timed(m: int) -> tuple[float, int]:
        start = steps["steps"]
        wall = timed_generate(llm, prompts, m)
        return wall, steps["steps"] - start

    measured = decode_step(timed, short, long, repeats=job.get("repeats", 2))
    d = counter_delta(spec_metrics(llm), before)
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    return {"step_ms": _ms(measured["step_s"]), "timing": measured,
            "spec_counters": d,
            "draft_tokens_per_draft": (d.get("vllm:spec_decode_num_draft_tokens", 0) / drafts
                                       if drafts else 0.0),
            "acceptance": (d.get("vllm:spec_decode_num_accepted_tokens", 0)
                           / d["vllm:spec_decode_num_draft_tokens"]
                           if d.get("vllm:spec_decode_num_draft_tokens") else None)}


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
