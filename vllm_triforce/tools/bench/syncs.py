"""SyncCounter: counts the calls that would make the host wait for a CUDA stream.

Terms. A *sync* is a call after which the host holds a value the device computed (or the
device holds one the host just built, through a blocking copy): `.item()`, `int(t)`,
`bool(t)`, `float(t)`, `.tolist()`, `.cpu()`, `.numpy()`, ops whose output size depends on
the data (`nonzero`, `unique`, `masked_select`, boolean-mask indexing, `repeat_interleave`
without `output_size`), blocking copies between device types, `torch.tensor(host_data,
device=...)`, an explicit `torch.cuda.synchronize` and a CUDA event's `synchronize`. On a
GPU each one stalls the host until the device has caught up; a decode step has room for a
handful.

How each kind is seen, so that each call counts once:
- ops that reach the dispatcher (`int(t)` ends in `aten::_local_scalar_dense`, `t[mask]` in
  `aten::index` with a bool index, ...) through a `TorchDispatchMode`; an op's own inner ops
  are not seen (the mode is off inside its handler);
- `Tensor.item/__int__/__index__/__bool__/__float__/tolist/cpu/numpy`, `torch.tensor`/
  `torch.as_tensor` with a `device`, `Tensor.to` with a device (on a CPU-only machine only:
  there `.to(device)` is a no-op the dispatcher never sees, on a GPU a blocking host-to-device
  copy), and `torch.cuda.synchronize` through Python wrappers
  (restored on exit): on CPU tensors `tolist/cpu/numpy` dispatch nothing at all, and under
  `torch.inference_mode` (vLLM's) neither does a scalar read. The dispatch mode is quiet
  inside a wrapper, so `int(t)` is not counted again as its `_local_scalar_dense`, nor a
  `.cpu()` of a CUDA tensor as its `_to_copy`.

`device_type` says which tensors live on the device: on a CUDA machine "cuda" (a scalar read
of a host tensor is no sync there and is not counted); on a CPU-only machine "cpu", where
every tensor counts -- including scalar reads of host-side tensors that would not sync on a
GPU -- and every `.to(device)` counts as a host-to-device copy, also of a tensor that would
already be on the device. CPU counts approximate GPU counts; they are not equal. Copies with
`non_blocking=True` are not counted (from or to pinned memory they do not block the host).

Counts are kept per *segment*: `mark(label)` starts a new one, so a caller can split one
`propose` into its middle rounds and the work outside them:

    with SyncCounter() as counter:      # label "step"
        ...
        counter.mark("round")           # hits from here on count for a new "round" segment
        ...
        counter.mark("step")
    counter.counts                      # Counter: label -> hits (all segments)
    counter.by_op                       # Counter: op -> hits
    [s.count for s in counter.segments if s.label == "round"]   # per round

`trace=True` also records, per hit, the innermost frame inside vllm_triforce (`sites`):
slow, for finding which lines sync. This module imports no vLLM.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_PACKAGE_DIR = str(Path(__file__).resolve().parents[2])  # vllm_triforce/
_THIS_FILE = str(Path(__file__).resolve())

# Under torch.inference_mode composite ops reach the mode undecomposed (`item`, one-argument
# `where`, `repeat_interleave.self_int`), outside it their parts do: both are listed.
SCALAR_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"})
DATA_SIZED_OPS = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique",
                            "_unique2", "unique_dim", "unique_consecutive",
                            "unique_dim_consecutive"})
INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
COPY_OPS = frozenset({"_to_copy", "copy_", "copy"})
BOOL_INDEX_DTYPES = (torch.bool, torch.uint8)
# Wrapped at the Python level: under torch.inference_mode (where vLLM runs) a scalar read of
# a CPU tensor does not reach the dispatcher, and tolist/cpu/numpy of one never do.
TENSOR_METHODS = ("item", "__int__", "__index__", "__bool__", "__float__", "tolist", "cpu",
                  "numpy")


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync_op_name(func, args, kwargs, device_type: str) -> str | None:
    """The name under which this aten call counts as a sync, or None if it is not one."""
    name = func.overloadpacket.__name__
    if name in SCALAR_OPS or name in DATA_SIZED_OPS:
        return name if _touches(args, device_type) else None
    if name == "where" and len(args) == 1:  # torch.where(condition) is nonzero
        return "nonzero" if _touches(args, device_type) else None
    if name == "repeat_interleave":  # self_int: repeats is a number, the size is known
        sized = kwargs.get("output_size") is not None or func._overloadname == "self_int"
        return None if sized or not _touches(args, device_type) else name
    if name in INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(isinstance(i, torch.Tensor) and i.dtype in BOOL_INDEX_DTYPES
                     for i in indices)
        return f"{name}(bool mask)" if masked and _touches(args, device_type) else None
    if name in COPY_OPS:
        return _cross_device_copy(name, args, kwargs)
    return None


def _touches(args, device_type: str) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == device_type
               for t in tree_leaves(args))


def _cross_device_copy(name: str, args, kwargs) -> str | None:
    if name == "_to_copy":
        source = args[0].device.type
        target = torch.device(kwargs["device"]).type if kwargs.get("device") else source
        non_blocking = kwargs.get("non_blocking", False)
    else:  # copy_(self, src, non_blocking=False): self is the target
        target, source = args[0].device.type, args[1].device.type
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if source == target or non_blocking:
        return None
    return f"{name}({source}->{target})"


@dataclasses.dataclass
class Segment:
    """The hits between one `mark` and the next."""
    label: str
    by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def count(self) -> int:
        return sum(self.by_op.values())


class _CountingMode(TorchDispatchMode):

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._quiet:
            name = sync_op_name(func, args, kwargs, self.counter.device_type)
            if name is not None:
                self.counter.hit(name)
        return func(*args, **kwargs)


class SyncCounter:
    """Context manager counting syncs on the thread that entered it (see the module
    docstring). `strict` (CUDA only): any sync inside raises, through
    `torch.cuda.set_sync_debug_mode("error")`."""

    _active: SyncCounter | None = None

    def __init__(self, strict: bool = False, trace: bool = False,
                 device_type: str | None = None, label: str = "step"):
        self.strict = strict
        self.trace = trace
        self.device_type = device_type or default_device_type()
        self.segments: list[Segment] = [Segment(label)]
        self.sites: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)  # label -> "file:line (function)" -> hits
        self._quiet = 0
        self._thread = threading.get_ident()
        self._mode = _CountingMode(self)
        self._restore: list[tuple[object, str, object]] = []
        self._debug_mode = None

    # ---- results --------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(s.count for s in self.segments)

    @property
    def counts(self) -> collections.Counter:
        """label -> hits over all its segments."""
        out = collections.Counter({s.label: 0 for s in self.segments})
        for s in self.segments:
            out[s.label] += s.count
        return out

    @property
    def by_op(self) -> collections.Counter:
        return sum((s.by_op for s in self.segments), collections.Counter())

    def by_label(self) -> dict[str, collections.Counter]:
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for s in self.segments:
            out[s.label].update(s.by_op)
        return dict(out)

    def counts_of(self, label: str) -> list[int]:
        """One count per segment labelled `label`, in order."""
        return [s.count for s in self.segments if s.label == label]

    # ---- recording ------------------------------------------------------------------
    def mark(self, label: str) -> None:
        """Hits from now on count for a new segment called `label`."""
        self.segments.append(Segment(label))

    def hit(self, op: str) -> None:
        segment = self.segments[-1]
        segment.by_op[op] += 1
        if self.trace:
            self.sites[segment.label][_site()] += 1

    # ---- installing -----------------------------------------------------------------
    def __enter__(self):
        if SyncCounter._active is not None:
            raise RuntimeError("SyncCounter does not nest: one is active already")
        SyncCounter._active = self
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name, self._tensor_wrapper)
        if self.device_type == "cpu":  # on a GPU the dispatcher sees these copies
            self._wrap(torch.Tensor, "to", self._to_wrapper)
        self._wrap(torch, "tensor", self._factory_wrapper)
        self._wrap(torch, "as_tensor", self._factory_wrapper)
        self._wrap(torch.cuda, "synchronize", self._synchronize_wrapper)
        if hasattr(torch.cuda.Event, "synchronize"):  # a CPU build's is a placeholder
            self._wrap(torch.cuda.Event, "synchronize",  # a wait for one recorded point
                       lambda original, _: self._synchronize_wrapper(original,
                                                                     "Event.synchronize"))
        if self.strict and torch.cuda.is_available():
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self._debug_mode = None
        while self._restore:
            owner, name, original = self._restore.pop()
            setattr(owner, name, original)
        SyncCounter._active = None

    def _wrap(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, make(original, name))

    def _counting(self, name: str, counts: bool):
        """Count `name` once (if `counts`, on this thread) and keep the mode quiet inside."""
        counter = self

        class _Quiet:
            def __enter__(self):
                if counts and threading.get_ident() == counter._thread and not counter._quiet:
                    counter.hit(name)
                counter._quiet += 1

            def __exit__(self, *exc):
                counter._quiet -= 1
        return _Quiet()

    def _tensor_wrapper(self, original, name):
        def wrapper(tensor, *args, **kwargs):
            with self._counting(name, tensor.device.type == self.device_type):
                return original(tensor, *args, **kwargs)
        return wrapper

    def _factory_wrapper(self, original, name):
        def wrapper(data, *args, **kwargs):
            device = kwargs.get("device")
            if device is None and name == "as_tensor" and len(args) > 1:
                device = args[1]  # as_tensor(data, dtype, device)
            to_device = (device is not None and not isinstance(data, torch.Tensor)
                         and torch.device(device).type == self.device_type)
            with self._counting(f"{name}(device=)", to_device):
                return original(data, *args, **kwargs)
        return wrapper

    def _to_wrapper(self, original, name):
        def wrapper(tensor, *args, **kwargs):
            to_device = isinstance(args[0], (str, torch.device)) if args else (
                kwargs.get("device") is not None)
            non_blocking = kwargs.get("non_blocking", False) or (
                to_device and len(args) > 2 and args[2] is True)  # to(device, dtype, True)
            with self._counting("to(device=)", to_device and not non_blocking):
                return original(tensor, *args, **kwargs)
        return wrapper

    def _synchronize_wrapper(self, original, name):
        def wrapper(*args, **kwargs):
            with self._counting(f"cuda.{name}", True):
                return original(*args, **kwargs)
        return wrapper


def _site() -> str:
    """The innermost frame inside vllm_triforce (but not this file) as "path:line (name)"."""
    for frame in reversed(traceback.extract_stack()):
        path = str(Path(frame.filename).resolve())
        if path.startswith(_PACKAGE_DIR) and path != _THIS_FILE:
            return f"{Path(path).relative_to(Path(_PACKAGE_DIR).parent)}:{frame.lineno} " \
                   f"({frame.name})"
    return "(outside vllm_triforce)"


class ProposeSyncs:
    """Counts the syncs of every `propose` of one TriForce proposer (engine/proposer.py),
    split into its middle rounds and the rest of the step: a *round* runs from one call of
    the middle loop's `on_round_start` seam (engine/middle.py) to the next, or to the end of
    `MiddleLoop.run` (so it includes `select_in_middle` and the round's bookkeeping);
    everything else in `propose` (StepBatch, commit, select, the hand-off) is the *step*
    (a plain step taken by `propose_plain_step`, patches/plain_propose.py, is one too),
    except the
    KV-cache key reader's one check at the engine's first commit (engine/paged_keys.py),
    labelled *once*, and the depth controller's planning (`DepthChooser.plan`), labelled
    *host*: core/controller.py computes on small CPU tensors it builds itself, and
    engine/plain_steps.py reads vLLM's host copies of a pass's lengths
    (`PlainSteps.read_v1`), no sync on a GPU (a CUDA counter sees none there), but on a
    CPU-only machine every tensor counts. Wraps the instance's `propose`, its middle loop's
    `run`, its depth chooser's `plan`, its plain steps' `read_v1` and the reader's
    `check` (instance attributes, removed on exit), and sets the middle loop's
    `on_round_start` (None again on exit); nothing is changed for other instances.
    `take()` returns one SyncCounter per propose since the last take; `summarise`
    condenses them."""

    def __init__(self, proposer, trace: bool = False, strict: bool = False):
        self.proposer = proposer
        self.trace, self.strict = trace, strict
        self.steps: list[SyncCounter] = []
        self._counter: SyncCounter | None = None

    def __enter__(self):
        proposer, middle = self.proposer, self.proposer.middle
        propose, run = proposer.propose, middle.run

        def counted_propose(*args, **kwargs):
            with SyncCounter(trace=self.trace, strict=self.strict) as self._counter:
                try:
                    return propose(*args, **kwargs)
                finally:
                    self.steps.append(self._counter)
                    self._counter = None

        def marked_run(*args, **kwargs):
            try:
                return run(*args, **kwargs)
            finally:
                self._counter.mark("step")

        proposer.propose, middle.run = counted_propose, marked_run
        plain_step = getattr(proposer, "propose_plain_step", None)
        if plain_step is not None:  # a plain step decided during vLLM's pass, done first
            def counted_plain_step():  # (patches/plain_propose.py): a step when it is one
                with SyncCounter(trace=self.trace, strict=self.strict) as self._counter:
                    try:
                        drafts = plain_step()
                    finally:
                        counter, self._counter = self._counter, None
                if drafts is not None:
                    self.steps.append(counter)
                return drafts

            proposer.propose_plain_step = counted_plain_step
        middle.on_round_start = lambda: self._counter.mark("round")
        proposer.depth.plan = self._labelled("host", proposer.depth.plan)
        plain = proposer.plain_steps  # reads vLLM's host copies of the pass's lengths
        plain.read_v1 = self._labelled("host", plain.read_v1)
        self._reader = proposer.retrieval.keeper.reader
        if self._reader is not None:  # its one check at the first commit: label "once"
            self._reader.check = self._labelled("once", self._reader.check)
        return self

    def _labelled(self, label: str, method):
        """`method`, its syncs counted in a segment `label`, then back to "step"."""
        def marked(*args, **kwargs):
            self._counter.mark(label)
            try:
                return method(*args, **kwargs)
            finally:
                self._counter.mark("step")

        return marked

    def __exit__(self, *exc) -> None:
        for owner, name in ((self.proposer, "propose"), (self.proposer, "propose_plain_step"),
                            (self.proposer.middle, "run"),
                            (self.proposer.depth, "plan"), (self._reader, "check"),
                            (self.proposer.plain_steps, "read_v1")):
            if owner is not None:
                owner.__dict__.pop(name, None)
        self.proposer.middle.on_round_start = None

    def take(self) -> list[SyncCounter]:
        steps, self.steps = self.steps, []
        return steps


def summarise(steps: list[SyncCounter]) -> dict:
    """Max and mean syncs per middle round and per step (outside the rounds, the "once" and
    "host" segments), their counts, hits per op and (traced counters) per site, for each
    label; "once" and "host" as totals."""
    rounds = [n for c in steps for n in c.counts_of("round")]
    per_step = [c.counts.get("step", 0) for c in steps]
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in steps:
        for label, ops in c.by_label().items():
            by_op[label].update(ops)
        for label, hits in c.sites.items():
            sites[label].update(hits)
    return {"max_round": max(rounds, default=0), "max_step": max(per_step, default=0),
            "num_rounds": len(rounds), "num_steps": len(steps),
            "mean_round": sum(rounds) / max(len(rounds), 1),
            "mean_step": sum(per_step) / max(len(per_step), 1),
            "once": sum(c.counts.get("once", 0) for c in steps),
            "host": sum(c.counts.get("host", 0) for c in steps),
            "by_op": {k: dict(v) for k, v in by_op.items()},
            "sites": {k: dict(v) for k, v in sites.items()}}
