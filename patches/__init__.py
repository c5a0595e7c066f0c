"""Every change vllm-triforce makes to vLLM, applied by one `apply()`.

Each patch module exposes `apply()` that is idempotent, checks the vLLM
version and that the symbol it replaces exists, wraps rather than copies, and
says in its docstring why no official API suffices.
"""

from vllm_triforce.patches import _util

# Order matters only where noted in a module's docstring.
PATCH_MODULES = (
    "spec_config",
    "runner",
    "attention_capture",
    "cpu_expand",
    "cpu_seed",
    "cli_args",
    "ray_cpu",
    "cpu_defaults",
    "kv_reservation",
    "cpu_flex",
)


def apply() -> None:
    import importlib

    _util.check_version()
    for name in PATCH_MODULES:
        importlib.import_module(f"vllm_triforce.patches.{name}").apply()


def applied() -> dict[str, bool]:
    """Which patches took effect in this process (for tests and debugging)."""
    return dict(_util.APPLIED)
