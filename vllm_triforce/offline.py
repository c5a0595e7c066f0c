"""The in-process offline engine: the one way the tools (demo, doctor, benchmarks) and the
tests build a vLLM `LLM` whose model runner and TriForce proposer they can reach, and free it.

In-process means `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core and its worker run in
the caller's process instead of a child, so the runner is an attribute path away. Depends on
vLLM 0.32.0's in-process layout:
LLM -> LLMEngine -> InprocClient -> EngineCore -> executor -> worker -> model runner.
"""

import gc
import os

IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def in_process_llm(model, speculative_config: dict | None = None, **engine_kwargs):
    """A `vllm.LLM` for `model` (a directory, a hub id or a Path) built in this process:
    `speculative_config` as `LLM` takes it (TriForce's, another method's, or None for plain
    vLLM), every other keyword passed to `LLM` as given. Free it with `free_llm` before the
    next one is built."""
    os.environ.update(IN_PROCESS_ENV)  # read when the LLMEngine is built, just below
    from vllm import LLM

    return LLM(str(model), speculative_config=speculative_config, **engine_kwargs)


def runner_of(llm):
    """The model runner of an in-process engine."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def drafter_of(llm):
    """The TriForce engine of an in-process engine: the V1 runner's `drafter` (a
    TriForceProposer), or Model Runner V2's `speculator` (a TriForceSpeculator, under
    `VLLM_TRIFORCE_MRV2=1`)."""
    from vllm_triforce.engine.drafting import host_of

    host = host_of(runner_of(llm))
    if host is None:
        raise ValueError("this engine runs no TriForce (its speculative config is not "
                         "method 'triforce')")
    return host


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
