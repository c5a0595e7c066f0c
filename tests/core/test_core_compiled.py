"""core/compiled.py: a warm-up's compilation runs with Python's garbage collector paused."""

import gc

import torch

from vllm_triforce.core.compiled import CompiledFunction


class _Reader:
    """Garbage only the collector frees (a cycle) whose `__del__` reads a tensor, as vLLM's
    CPU GEMM handler does: collected inside a trace, that read fails the compilation."""

    freed = 0

    def __init__(self):
        self.tensor = torch.ones(1)
        self.cycle = self

    def __del__(self):
        self.tensor.item()
        _Reader.freed += 1


def test_the_warm_up_collects_first_and_compiles_with_the_collector_paused():
    compiled = CompiledFunction(lambda x: x * 2)
    seen, real = [], compiled._compiled

    def spy(*args, **kwargs):  # what the collector does while torch.compile runs
        seen.append((gc.isenabled(), _Reader.freed))
        return real(*args, **kwargs)

    compiled._compiled = spy
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _Reader.freed = 0
        for _ in range(3):
            _Reader()
        gc.enable()
        out = compiled(torch.ones(2), compile_now=True)
        compiled(torch.ones(2))  # a later call: the collector runs as it likes
    finally:
        if not was_enabled:
            gc.disable()
    assert torch.equal(out, torch.full((2,), 2.0))
    assert seen == [(False, 3), (True, 3)]  # collected before, paused during, on after
    assert gc.isenabled() == was_enabled
