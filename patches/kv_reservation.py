"""Reserve TriForce's own memory before vLLM sizes the KV cache.

Upstream (vLLM 0.32.0): `Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py)
and `CPUWorker.determine_available_memory` (vllm/v1/worker/cpu_worker.py) return the bytes
the engine core turns into KV blocks (`EngineCore._initialize_kv_caches`). They run after
the profile run and before `initialize_kv_cache`, so the TriForce proposer's allocations
(block summaries, probability rows, scratch; vllm_triforce/engine/memory.py) are not in the
profile and would come on top of `gpu_memory_utilization`.

How: wrap both methods; when the worker's runner holds a TriForce proposer (V1's
`drafter`, or Model Runner V2's `speculator` under `VLLM_TRIFORCE_MRV2=1`), hand vLLM the
budget `proposer.reserve_memory(available)` leaves (fewer KV blocks; the proposer logs the
reservation and its share, and refuses, with TriForce's own error, a budget that then holds
no `max_model_len` request). Any other engine is untouched. While the original runs, the
host's `sizing_kv_cache` is set: on a GPU vLLM's CUDA-graph memory profile
(`GPUModelRunner.profile_cudagraph_memory`) builds the proposer once over a minimal KV cache
(`_init_minimal_kv_cache_for_profiling`) before the real one, and the host leaves its
compilations for the real build (engine/drafting.py `_build_drafting`).

Why a patch: vLLM 0.32 has no hook for a proposer to declare memory it will allocate, and
its profile run does not call the proposer's allocations (they happen in
`initialize_attn_backend`, after sizing). Remove when vLLM lets a drafter report extra
memory to the KV sizing (no upstream issue known).
"""

from vllm_triforce.patches import _util

NAME = "kv_reservation"
GPU_TARGET = ("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory")
# CPUWorker overrides it; its module is imported only on CPU (it sets up CPU shared memory).
CPU_TARGET = ("vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory")


def apply() -> None:
    from vllm.platforms import current_platform

    _util.wrap(*GPU_TARGET, _make_wrapper, NAME)
    if current_platform.is_cpu():
        _util.wrap(*CPU_TARGET, _make_wrapper, NAME)


def _make_wrapper(original):
    def determine_available_memory(self, *args, **kwargs):
        from vllm_triforce.engine.drafting import host_of

        host = host_of(getattr(self, "model_runner", None))
        if host is None:
            return original(self, *args, **kwargs)
        host.sizing_kv_cache = True  # a build in here is over vLLM's minimal profiling cache
        try:
            available = original(self, *args, **kwargs)
        finally:
            host.sizing_kv_cache = False
        return host.reserve_memory(available)

    return determine_available_memory
