"""Functions of TriForce's hot path compiled once, at start-up, for every size
(`compiled_selection`, config.py): torch.compile (inductor) with the sizes that vary from
call to call marked unbacked by the caller at the warm-up's call (dynamo's
`mark_unbacked`), so a size never seen compiles nothing: the compiled code has no guard
on those sizes, and later calls need no mark.

A call costs some 450 lines of torch's Python (dynamo's frame callback, its guards, the
stance, the compiled wrapper) besides its launches: on a GPU's host about what two or
three eager operations cost, where each of these functions replaces twenty or more.

After its warm-up such a function never compiles again: a call that would (a guard no
size should fail) raises, under dynamo's stance "fail_on_recompile", rather than compile
on the hot path or fall back silently to eager torch (which, for the block scores, would
hold every decoded row); the caller then takes its eager path, with a warning.

The warm-up compiles with Python's garbage collector paused (collected first): an object
collected mid-trace runs its `__del__` inside dynamo's fake-tensor mode, and one whose
`__del__` reads a tensor (vLLM's CPU GEMM handler calls `.item()`) fails the compilation
("GuardOnDataDependentSymNode", "you set no_dispatch()"), leaving that part eager. Under a
Python dispatch mode (tools/bench: the sync counter) dynamo compiles nothing, so the same
function runs eagerly there, where the mode sees its operations.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode


class CompiledFunction:
    """`fn` compiled (dynamic shapes, one graph), called as `fn` is."""

    def __init__(self, fn):
        self.eager = fn
        self._compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, *args, compile_now: bool = False, **kwargs):
        """`compile_now`: the warm-up's call, which may compile; any other raises where it
        would. `kwargs`: `fn`'s keyword arguments (a function's own constants, given at
        each call rather than bound by functools.partial: torch.compile runs every partial
        through one shared frame, whose recompile limit all of them would share)."""
        if _get_current_dispatch_mode() is not None:
            return self.eager(*args, **kwargs)
        stance = "default" if compile_now else "fail_on_recompile"
        with contextlib.ExitStack() as scope:
            if compile_now:
                scope.enter_context(collector_paused())
            if not torch.is_inference_mode_enabled():  # one grad mode for every call
                scope.enter_context(torch.inference_mode())
            scope.enter_context(torch.compiler.set_stance(stance))
            return self._compiled(*args, **kwargs)


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector run now, then paused until the block ends (module
    docstring: no `__del__` inside a trace); as it was before, after."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line: what a warning about a compiled function
    shows (inductor's messages run to twenty lines of advice on environment variables)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def dense(t: Tensor) -> Tensor:
    """`t` with the strides of a new tensor of its shape (dynamo guards on them, even
    along a dimension of size 1, where a view's may differ): a copy where they differ."""
    if t.is_contiguous() and 1 not in t.shape:  # strides only a size-1 dimension can bend
        return t
    expected, stride = [], 1
    for size in reversed(t.shape):
        expected.insert(0, stride)
        stride *= size
    return t if list(t.stride()) == expected else t.clone(memory_format=torch.contiguous_format)


def inference(t: Tensor) -> Tensor:
    """`t` as an inference tensor (vLLM runs the engine in inference mode, so its tensors
    are; dynamo guards on the difference): a copy where it is not (a test's, say)."""
    if t.is_inference():
        return t
    with torch.inference_mode():
        return t.clone()
