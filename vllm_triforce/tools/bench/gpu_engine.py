"""The in-process engine as the GPU check's jobs (gpu_job.py, gpu_costs.py) build and read
it: its facts (KV blocks, backend, CUDA-graph mode, runner, TriForce's reservation), vLLM's
step count, prompts of token ids and the top-2 log-prob margins of an output."""

from __future__ import annotations

from vllm_triforce.offline import in_process_llm, runner_of


def build_llm(job: dict):
    return in_process_llm(job["model"], job.get("spec"), disable_log_stats=False, **job["llm"])


def drafter_or_none(llm):
    """The TriForce engine of `llm`: the V1 runner's proposer or Model Runner V2's
    speculator (`VLLM_TRIFORCE_MRV2=1`); None for any other engine."""
    from vllm_triforce.engine.drafting import host_of

    return host_of(runner_of(llm))


def engine_facts(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    facts = {"num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
             "block_size": cfg.cache_config.block_size,
             "runner": type(runner).__module__ + "." + type(runner).__name__,
             "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "cudagraph_capture_sizes": _sizes(cfg.compilation_config.cudagraph_capture_sizes),
             "speculative_method": getattr(cfg.speculative_config, "method", None),
             "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
             "max_num_seqs": cfg.scheduler_config.max_num_seqs,
             "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
             "gpu_memory_utilization": cfg.cache_config.gpu_memory_utilization}
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


def _sizes(sizes) -> list[int] | str:
    """The CUDA-graph sizes vLLM captured (after its own adjustments): listed when few."""
    sizes = sorted(sizes or [])
    return sizes if len(sizes) <= 16 else f"{len(sizes)} sizes, {sizes[0]} to {sizes[-1]}"


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


def token_prompts(specs: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in specs]


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def top2_margins(completion) -> list[float]:
    """Per position, log p(top-1) - log p(top-2) of the engine's own distribution."""
    out = []
    for position in completion.logprobs or []:
        values = sorted((lp.logprob for lp in position.values()), reverse=True)
        out.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return out
