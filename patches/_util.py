"""Shared helpers for the patches: version gate, symbol checks, idempotent wrapping."""

import functools
import importlib
from typing import Any, Callable

PATCHED_ATTR = "__vllm_triforce_patched__"
APPLIED: dict[str, bool] = {}


def check_version() -> None:
    import vllm

    from vllm_triforce import check_vllm_version

    check_vllm_version(vllm.__version__)


def resolve(module: str, qualname: str) -> tuple[Any, str, Any]:
    """Return (owner, attr, current) for `module:qualname`, or raise naming it."""
    mod = importlib.import_module(module)
    owner: Any = mod
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or not hasattr(owner, attr):
        raise RuntimeError(
            f"vllm-triforce: expected {module}.{qualname} in vLLM; it is missing. "
            "This vLLM build is not one the patches were written for "
            "(`vllm-triforce contract` lists every symbol the plugin relies on).")
    return owner, attr, getattr(owner, attr)


def is_patched(fn: Any) -> bool:
    return bool(getattr(fn, PATCHED_ATTR, False))


def _patch_names(fn: Any) -> tuple:
    fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
    marker = getattr(fn, PATCHED_ATTR, ())
    return marker if isinstance(marker, tuple) else ()


def wrap(module: str, qualname: str, make_wrapper: Callable[[Callable], Callable],
         name: str) -> None:
    """Replace `module.qualname` by `make_wrapper(original)` once.

    The wrapper keeps the original reachable as `__wrapped__` (functools.wraps).
    """
    owner, attr, current = resolve(module, qualname)
    raw = owner.__dict__.get(attr, current) if isinstance(owner, type) else current
    applied_names = _patch_names(raw)
    if name in applied_names:
        APPLIED[name] = True
        return
    original = current
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    # Several patches may wrap one symbol: the marker lists every patch in the chain.
    setattr(wrapper, PATCHED_ATTR, (*applied_names, name))
    if isinstance(raw, staticmethod):
        wrapper = staticmethod(wrapper)
    elif isinstance(raw, classmethod):
        wrapper = classmethod(wrapper)
    setattr(owner, attr, wrapper)
    APPLIED[name] = True


def replace(module: str, qualname: str, new: Callable, name: str) -> None:
    """Replace `module.qualname` by `new` (which must not call the original)."""
    owner, attr, current = resolve(module, qualname)
    if is_patched(current):
        APPLIED[name] = True
        return
    functools.update_wrapper(new, current)
    setattr(new, PATCHED_ATTR, True)
    setattr(owner, attr, new)
    APPLIED[name] = True
