"""HostOps: the aten operations TriForce's `propose` dispatches outside the model, by call
site, with the host time each took.

On a GPU every operation is a kernel launch (or a view the host still dispatches), and
the host time of one is its dispatch and launch, not the kernel's device time, which
runs later, asynchronously: the sum over a middle round is the host work a round costs
besides its Python. On a CPU an operation's host time also holds its computation. A
pass's model (`forward.run` today, a bucket's closure with round graphs) is not counted:
its operations are the device work, or a graph replay that dispatches none. The compiled
functions (`compiled_selection`, core/compiled.py) run with the mode off (dynamo compiles
nothing under one) and count as one site, their launches' host time; so does a selection
graph's run (`selection_graphs`), its closure's operations the device's work.

    with HostOps(drafter) as ops:
        llm.generate(...)
    ops.per_round(rounds)   # [(site, operations per round, host ms per round)], busiest first

A site is the innermost vllm_triforce frame of the stack, "file:line function" (stack
reads cost tens of microseconds an operation: outside the timed part, but the generation
runs slower under the mode).
"""

from __future__ import annotations

import collections
import time
import traceback

GRAPH_LAUNCH = "(a CUDA graph's launch)"  # the site a round graph's replay counts at
COMPILED_LAUNCH = "(a compiled function's launch)"  # core/compiled.py's, each call
# a middle round's re-selection and load as one graph (`selection_graphs`): one launch,
# its work the device's (engine/device/selection_graph.py)
SELECTION_LAUNCH = "(a selection graph's launch)"


class HostOps:
    """Counts and times every aten operation `drafter.propose` dispatches outside the
    model passes, by call site, while installed (`with`)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.counts: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self._in_model = 0
        self._restore: list = []

    def __enter__(self) -> "HostOps":
        from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

        from vllm_triforce.core.compiled import CompiledFunction
        from vllm_triforce.engine.device import forward, round_graph
        from vllm_triforce.engine.device.selection_graph import SelectionGraphs

        owner = self

        class Timing(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if owner._in_model:
                    return func(*args, **(kwargs or {}))
                start = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                elapsed = time.perf_counter() - start
                site = call_site()
                owner.counts[site] += 1
                owner.seconds[site] += elapsed
                return out

        def uncounted(run, site=None, unwatched=False):
            """`run` with its operations not counted; `site`: its own wall time counted
            there (a graph's launch, which dispatches no aten operation), unless it runs
            inside another uncounted call (a compiled function inside a selection graph's
            run); `unwatched`: run with the mode off (a compiled function, which dynamo
            compiles under none)."""
            def wrapped(*args, **kwargs):
                outermost = self._in_model == 0
                self._in_model += 1
                start = time.perf_counter()
                try:
                    if unwatched:
                        with _disable_current_modes():
                            return run(*args, **kwargs)
                    return run(*args, **kwargs)
                finally:
                    self._in_model -= 1
                    if site is not None and outermost:
                        self.counts[site] += 1
                        self.seconds[site] += time.perf_counter() - start
            return wrapped

        propose = self.drafter.propose
        self._own_propose = self.drafter.__dict__.get("propose")  # another's wrapper

        def timed_propose(*args, **kwargs):
            with Timing():
                return propose(*args, **kwargs)

        self._restore = [(forward, "run", forward.run, None, False),
                         (round_graph.BucketPass, "closure", round_graph.BucketPass.closure,
                          None, False),
                         (round_graph.CudaGraphReplay, "run", round_graph.CudaGraphReplay.run,
                          GRAPH_LAUNCH, False),
                         (CompiledFunction, "__call__", CompiledFunction.__call__,
                          COMPILED_LAUNCH, True),
                         (SelectionGraphs, "launch", SelectionGraphs.launch, SELECTION_LAUNCH,
                          True)]
        for holder, name, value, site, unwatched in self._restore:
            setattr(holder, name, uncounted(value, site, unwatched))
        self.drafter.propose = timed_propose
        return self

    def __exit__(self, *exc) -> None:
        for holder, name, value, *_ in self._restore:
            setattr(holder, name, value)
        if self._own_propose is not None:
            self.drafter.propose = self._own_propose
        else:
            del self.drafter.propose  # the instance's wrapper: the class's method again

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_round(self, rounds: int, top: int | None = None) -> list[tuple[str, float, float]]:
        """(site, operations per round, host ms per round) of the `top` sites with the most
        host time (all: None), over `rounds` middle rounds."""
        ranked = sorted(self.counts, key=lambda s: self.seconds[s], reverse=True)[:top]
        return [(site, self.counts[site] / rounds, 1000 * self.seconds[site] / rounds)
                for site in ranked]

    def summary(self, rounds: int, top: int = 40) -> dict:
        """What a report keeps: totals per round and the busiest sites."""
        return {"rounds": rounds, "ops_per_round": self.total / rounds if rounds else None,
                "host_ms_per_round": (1000 * sum(self.seconds.values()) / rounds
                                      if rounds else None),
                "sites": [{"site": s, "ops": round(n, 2), "host_ms": round(ms, 4)}
                          for s, n, ms in self.per_round(rounds, top)] if rounds else []}


def call_site() -> str:
    """The innermost vllm_triforce frame of the current stack, as file:line function."""
    for frame in reversed(traceback.extract_stack(limit=30)):
        if "vllm_triforce" in frame.filename and "host_ops.py" not in frame.filename:
            return f"{frame.filename.split('vllm_triforce/')[-1]}:{frame.lineno} {frame.name}"
    return "?"
