"""Engine helpers shared by test modules (import these, not conftest: tests/core has its own)."""

import gc

DEFAULT_MAX_MODEL_LEN = 1024


def make_engine_kwargs(**over) -> dict:
    """Deterministic, fast `vllm.LLM` kwargs for tiny CPU models; `over` wins."""
    kwargs = dict(dtype="float32", enforce_eager=True, block_size=32, seed=0,
                  max_model_len=DEFAULT_MAX_MODEL_LEN)
    kwargs.update(over)
    return kwargs


def free_llm(llm) -> None:
    """Shut an in-process engine down and release its memory before the next one."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm, engine, core
    cleanup_dist_env_and_memory()
    gc.collect()
