"""vllm-triforce: TriForce hierarchical speculative decoding as a vLLM plugin.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every
process it starts (front end, engine core, each worker, Ray actors). It must be
idempotent and import nothing heavy at module import time.
"""

__version__ = "0.1.0"

_registered = False


def check_vllm_version(found: str) -> None:
    """Refuse a vLLM release the patches were not written for (vllm_triforce/compat.py)."""
    from vllm_triforce.compat import check_vllm_version as check

    check(found, __version__)


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
