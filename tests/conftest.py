"""Shared fixtures: tiny models, the offline CPU engine environment, engine kwargs.

Fixtures (keep the names, other test files depend on them):
- `tiny_llama`, `tiny_qwen2`, `tiny_draft`: paths of tiny random models built
  once per session (see tests/tiny_models.py).
- `smollm2`: path of SmolLM2-135M via `vllm_triforce.assets.ensure_model`,
  resolved only when a test asks for it.
- `engine_env`: the environment every in-process vLLM engine here runs in
  (set in `pytest_configure`, i.e. before any test module imports vLLM).
- `engine_kwargs(**over)`: keyword arguments for `vllm.LLM`.
- `free_llm(llm)` / the `llm_factory` fixture: build in-process engines
  (`vllm_triforce.offline.in_process_llm`) and free them.

Mark tests that build an engine with `@pytest.mark.engine`.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny_models` from tests

import pip_resolutions  # noqa: E402
import suite_order  # noqa: E402
import tiny_models  # noqa: E402
from engine_helpers import (DEFAULT_MAX_MODEL_LEN, free_llm, in_process_llm,  # noqa: E402,F401
                            make_engine_kwargs)

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core + worker in this process
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    # VLLM_CACHE_ROOT is a per-session temp dir, added in pytest_configure.
}


def pytest_configure(config):
    cache_root = tempfile.mkdtemp(prefix="vllm-triforce-cache-")
    config._vllm_cache_root = cache_root
    os.environ.update(ENGINE_ENV, VLLM_CACHE_ROOT=cache_root)
    _one_thread_per_worker()


def _one_thread_per_worker() -> None:
    """Under pytest-xdist with a worker per core (scripts/test.sh on 2 cores), each worker's
    torch, its in-process engines and the processes it starts use one OpenMP thread: two
    workers of one thread per core each, not 2 x 2 threads whose parallel regions wait on
    each other. Set before any engine: vLLM's CPU worker makes `torch.set_num_threads` a
    no-op once it has started. Tests that choose threads themselves (tensor parallelism's
    VLLM_CPU_OMP_THREADS_BIND) still do."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and workers >= (os.cpu_count() or 1):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    suite_order.longest_files_first(items)


def pytest_collection_finish(session):
    """The `[gpu]` extra's resolutions start now, if their test was collected: they wait
    on the network beside the tests that use the cores (tests/pip_resolutions.py)."""
    pip_resolutions.start_if_selected(session)


def pytest_unconfigure(config):
    cache_root = getattr(config, "_vllm_cache_root", None)
    if cache_root:
        shutil.rmtree(cache_root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def engine_env() -> dict[str, str]:
    """The engine environment (already in os.environ); returned for subprocess tests."""
    return {key: os.environ[key] for key in (*ENGINE_ENV, "VLLM_CACHE_ROOT")}


@pytest.fixture(scope="session")
def engine_kwargs():
    """The `make_engine_kwargs` function: `LLM(path, **engine_kwargs(max_model_len=512))`."""
    return make_engine_kwargs


@pytest.fixture
def llm_factory(engine_kwargs):
    """`make(model, **over)` builds an in-process `vllm.LLM`; every one is freed after the
    test."""
    built = []

    def make(model, **over):
        built.append(in_process_llm(model, **engine_kwargs(**over)))
        return built[-1]

    yield make
    while built:
        free_llm(built.pop())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return tiny_models.build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    return tiny_models.build_tiny_llama_draft(tmp_path_factory.mktemp("tiny_draft"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from vllm_triforce.assets import ensure_model  # written elsewhere; import lazily

    return Path(ensure_model("smollm2-135m"))
