"""Helpers for in-process offline engines (demo, benchmarks, tests).

Depends on vLLM 0.32.0's in-process layout (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
LLM -> LLMEngine -> InprocClient -> EngineCore -> executor -> worker -> model runner.
"""

import gc


def drafter_of(llm):
    """The TriForceProposer of an in-process engine (model runner's `drafter`)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter


def free_llm(llm) -> None:
    """Shut an engine down and release its memory before the next one is built."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm, engine, core
    cleanup_dist_env_and_memory()
    gc.collect()
