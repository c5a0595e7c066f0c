"""The doctor's child process: one engine, built in this process (vllm_triforce/offline.py)
so that its model runner and proposer can be read, timed on the job's prompts and described.

    python -m vllm_triforce.tools.doctor_engine JOB.json RESULT.json

JOB.json: model, spec (null for plain vLLM), prompts (token ids), max_tokens, dtype,
max_model_len. RESULT.json: the greedy tokens, prefill and decode speed, plain vLLM's top
log-probs off CPU, what the engine runs on (`describe_engine`), vLLM's spec-decode counters
and TriForce's. vLLM logs to this process's stdout, so the result goes to a file; the
parent (doctor.py) judges it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PLAIN_LOGPROBS = 5
WARMUP_TOKENS = 4


def run_child(job: dict) -> dict:
    """Build one engine, prefill, time a greedy generation, describe the engine."""
    from vllm import SamplingParams

    from vllm_triforce.engine.drafting import host_of
    from vllm_triforce.offline import free_llm, in_process_llm, runner_of
    from vllm_triforce.tools.bench.worker import spec_metrics

    llm = in_process_llm(job["model"], job["spec"], seed=0, max_model_len=job["max_model_len"],
                         disable_log_stats=False, enable_prefix_caching=True,
                         **_device_kwargs(job["dtype"]))
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    # Prefill alone (the timed run then hits the prefix cache), then an untimed warm-up:
    # the first decode steps pay one-off initialisation (as in bench/worker.py).
    prefill_s = _timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=1))[0]
    _timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS,
                                        ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=_logprobs_wanted(job))
    decode_s, outs = _timed(llm, prompts, params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    host = host_of(runner_of(llm))
    stats = host.stats if host is not None else None
    result = {"tokens": tokens, "prefill_s": prefill_s,
              "tok_s": sum(map(len, tokens)) / decode_s, "logprobs": _top_logprobs(outs),
              "engine": describe_engine(llm), "vllm_spec": spec_metrics(llm),
              "triforce": stats.snapshot() if stats is not None else None}
    free_llm(llm)
    return result


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _logprobs_wanted(job: dict) -> int | None:
    """Off CPU, plain vLLM also returns its top log-probs, to tell a near-tie from a loss
    (doctor.NEAR_TIE_NATS); a top-5 per token costs little next to a forward."""
    from vllm.platforms import current_platform

    return None if job["spec"] or current_platform.is_cpu() else PLAIN_LOGPROBS


def _device_kwargs(dtype: str | None) -> dict:
    """CPU: fp32 + eager, the settings under which outputs are exactly comparable
    (CPU_ATTN needs blocks of 32). Elsewhere vLLM's defaults, so the run exercises the
    CUDA graphs and backend a user gets."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return {"dtype": dtype or "float32", "enforce_eager": True, "block_size": 32}
    return {"dtype": dtype or "auto"}


def describe_engine(llm) -> dict:
    """What TriForce depends on, read from the built engine (not from what we asked for)."""
    import vllm
    from vllm.platforms import current_platform

    from vllm_triforce.engine.drafting import host_of
    from vllm_triforce.offline import runner_of

    config = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    mode = config.compilation_config.cudagraph_mode
    drafter = host_of(runner)
    from vllm_triforce.tools.cpu_openmp import runtime_in_use

    return {"platform": _platform_name(current_platform),
            "device_type": current_platform.device_type,
            "openmp": runtime_in_use(),
            "vllm_version": vllm.__version__,
            "cudagraph_mode": getattr(mode, "name", str(mode)),
            "enforce_eager": bool(config.model_config.enforce_eager),
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            # V2 lives in vllm/v1/worker/gpu/model_runner.py, V1 in gpu_model_runner.py.
            "runner": "V2" if ".worker.gpu." in type(runner).__module__ + "." else "V1",
            "runner_class": type(runner).__name__,
            "attention_backends": _backend_names(runner),
            "drafter": type(drafter).__name__ if drafter is not None else "none",
            "reserved_bytes": getattr(drafter, "reserved_bytes", None),
            "key_reader": getattr(getattr(getattr(drafter, "retrieval", None), "keeper", None),
                                  "status", None)}


def _platform_name(platform) -> str:
    if platform.is_cpu():
        return "cpu"
    try:
        return f"{platform.device_type}: {platform.get_device_name()}"
    except Exception:  # a platform without device names still gets a report line
        return platform.device_type


def _backend_names(runner) -> list[str]:
    groups = getattr(runner, "attn_groups", None) or []
    return sorted({g.backend.get_name() for per_kv in groups for g in per_kv})


def _top_logprobs(outs) -> list[list[dict]] | None:
    """Per request, per token: {token id (str): log-prob} of plain vLLM's top choices."""
    if outs[0].outputs[0].logprobs is None:
        return None
    return [[{str(tok): lp.logprob for tok, lp in step.items()}
             for step in o.outputs[0].logprobs] for o in outs]


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run_child(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
