"""Let `distributed_executor_backend="ray"` run on the CPU platform.

Why a patch: vLLM 0.32 gates Ray on `Platform.ray_device_key`, which the CPU
platform leaves empty (`ValueError: current platform cpu does not support
ray.`, `v1/executor/ray_utils.py`). No configuration option sets it, and a
platform plugin would have to replace the whole CPU platform (and would clash
with real platform plugins). Three small changes make Ray work. They are made
only when `current_platform.is_cpu()`: on a GPU, Ray and vLLM's own worker
class run untouched and `applied()["ray_cpu"]` is False.

1. `CpuPlatform.ray_device_key = "CPU"`: every worker gets a `{"CPU": 1}`
   placement-group bundle, i.e. one reserved core per TP/PP rank, on the node
   Ray places it. (Thread pinning inside a node still follows
   `VLLM_CPU_OMP_THREADS_BIND`, exactly as with the `mp` executor.)
2. `RayExecutorV2._get_actor_resource_kwargs`: for a non-GPU key it asks for
   `resources={key: n}`, which Ray refuses for "CPU" ("Use the 'num_cpus' ...
   keyword"). On CPU we return `{"num_gpus": 0}`: the actor runs inside its
   bundle with `num_cpus=0`, the same way GPU actors do.
3. `RayWorkerProc.get_node_and_physical_gpu_ids` reads
   `get_accelerator_ids()[key]`; Ray has no accelerator ids for CPUs
   (KeyError). On CPU the worker has no device ids: it returns an empty list,
   and its local rank still comes from its position among the node's workers.
   This method runs inside the Ray actor *before* that process loads vLLM's
   general plugins (they load in `init_worker`, later), so a monkeypatch made
   in the driver cannot reach it. Instead the actor class itself is replaced
   by a subclass defined here; Ray pickles it by reference, so each actor
   imports this module and runs the override.

Only the V2 Ray executor (vLLM 0.32's default,
`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1`) is covered.
"""

import functools

from vllm.logger import init_logger

from vllm_triforce.patches import _util

logger = init_logger("vllm.triforce")

NAME = "ray_cpu"
RAY_CPU_KEY = "CPU"
_EXECUTOR_MODULE = "vllm.v1.executor.ray_executor_v2"
WORKER_CLASS = "CpuAwareRayWorkerProc"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _make_resource_kwargs(_original):
    # Wrapped (not replaced) only so `_util.wrap` keeps the staticmethod and `__wrapped__`.
    def _get_actor_resource_kwargs():
        # Installed on CPU only. The {"CPU": 1} bundle is the reservation; Ray
        # forbids "CPU" in `resources`, and num_cpus=0 is already passed by the caller.
        return {"num_gpus": 0}

    return _get_actor_resource_kwargs


@functools.cache
def _cpu_aware_worker_proc() -> type:
    """`RayWorkerProc` that reports no device ids on the CPU platform, made on first use:
    importing vLLM's Ray executor fails where Ray is not installed (vLLM 0.32's
    `ray_executor_v2` annotates with Ray's `ObjectRef` at class level: NameError), so this
    module must not import it unless the patch is applied. Ray (cloudpickle) pickles the
    class by reference, as `vllm_triforce.patches.ray_cpu.CpuAwareRayWorkerProc`: each
    actor imports this module, whose `__getattr__` makes the class again there."""
    base = _util.resolve(_EXECUTOR_MODULE, "RayWorkerProc")[2]

    class CpuAwareRayWorkerProc(base):  # type: ignore[misc, valid-type]
        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            # Installed as `RayWorkerProc` on CPU only (see apply()).
            from vllm.v1.executor.ray_utils import ray

            return ray.get_runtime_context().get_node_id(), []

    CpuAwareRayWorkerProc.__qualname__ = WORKER_CLASS
    CpuAwareRayWorkerProc.__module__ = __name__
    setattr(CpuAwareRayWorkerProc, _util.PATCHED_ATTR, True)
    return CpuAwareRayWorkerProc


def __getattr__(name: str):  # PEP 562: the worker class, for Ray's unpickling
    if name == WORKER_CLASS:
        return _cpu_aware_worker_proc()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _swap_worker_proc() -> None:
    owner, attr, current = _util.resolve(_EXECUTOR_MODULE, "RayWorkerProc")
    if not _util.is_patched(current):
        setattr(owner, attr, _cpu_aware_worker_proc())


def _set_device_key() -> None:
    owner, attr, current = _util.resolve("vllm.platforms.cpu", "CpuPlatform.ray_device_key")
    if current not in ("", RAY_CPU_KEY):
        logger.warning("CpuPlatform.ray_device_key is already %r; leaving it.", current)
        return
    setattr(owner, attr, RAY_CPU_KEY)


def apply() -> None:
    """On CPU: the three changes above. Elsewhere: nothing, recorded as not applied, so
    a GPU run never depends on this patch (its Ray path is vLLM's own)."""
    _util.check_version()
    if not _on_cpu():
        _util.APPLIED[NAME] = False
        logger.debug("ray_cpu: not a CPU platform; Ray's worker class left as vLLM's.")
        return
    _set_device_key()
    _util.wrap(_EXECUTOR_MODULE, "RayExecutorV2._get_actor_resource_kwargs",
               _make_resource_kwargs, NAME)
    _swap_worker_proc()
    _util.APPLIED[NAME] = True

