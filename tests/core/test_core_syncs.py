"""SyncCounter (vllm_triforce/tools/bench/syncs.py) on CPU tensors: every kind of sync counts
exactly once, under plain autograd mode and under torch.inference_mode (vLLM's), and nothing
else counts."""

import subprocess
import sys

import pytest
import torch

from vllm_triforce.tools.bench.syncs import SyncCounter

T = torch.arange(6)           # [6] = 0 .. 5
MASK = torch.arange(6) > 2    # [6] three True

ONE_SYNC = {  # call -> the op it counts as
    "int(t)": (lambda t, m: int(t[0]), "__int__"),
    "t.item()": (lambda t, m: t[1].item(), "item"),
    "bool(t)": (lambda t, m: bool(t[0]), "__bool__"),
    "if t": (lambda t, m: 1 if m.any() else 0, "__bool__"),
    "float(t)": (lambda t, m: float(t[0]), "__float__"),
    "list[t]": (lambda t, m: [7, 8][t[1]], "__index__"),
    "t.tolist()": (lambda t, m: t.tolist(), "tolist"),
    "t.cpu()": (lambda t, m: t.cpu(), "cpu"),
    "t.numpy()": (lambda t, m: t.numpy(), "numpy"),
    "t.nonzero()": (lambda t, m: t.nonzero(), "nonzero"),
    "torch.where(m)": (lambda t, m: torch.where(m), "nonzero"),
    "t[mask]": (lambda t, m: t[m], "index(bool mask)"),
    "t[mask] = v": (lambda t, m: t.clone().__setitem__(m, torch.zeros(3, dtype=t.dtype)),
                    "index_put_(bool mask)"),
    "torch.unique": (lambda t, m: torch.unique(t), "_unique2"),
    "torch.unique(dim=)": (lambda t, m: torch.unique(t[None], dim=1), "unique_dim"),
    "unique_consecutive": (lambda t, m: torch.unique_consecutive(t), "unique_consecutive"),
    "masked_select": (lambda t, m: t.masked_select(m), "masked_select"),
    "repeat_interleave(t, t)": (lambda t, m: torch.repeat_interleave(t, t), "repeat_interleave"),
    "t.repeat_interleave(t)": (lambda t, m: t.repeat_interleave(t), "repeat_interleave"),
    "torch.argwhere": (lambda t, m: torch.argwhere(m), None),
    "torch.allclose": (lambda t, m: torch.allclose(t, t), None),
    "torch.equal": (lambda t, m: torch.equal(t, t), "equal"),
    "t.to(device)": (lambda t, m: t.to(t.device), "to(device=)"),
    "t.to(device=, dtype=)": (lambda t, m: t.to(device="cpu", dtype=torch.int32),
                              "to(device=)"),
    "torch.tensor(device=)": (lambda t, m: torch.tensor([1, 2], device=t.device),
                              "tensor(device=)"),
    "torch.as_tensor(device=)": (lambda t, m: torch.as_tensor([1, 2], device=t.device),
                                 "as_tensor(device=)"),
}

NO_SYNC = {
    "arithmetic": lambda t, m: (t * 2 + 1).sum().argmax(),
    "device-side reductions": lambda t, m: (m.any(), t.max(), torch.where(m, t, 0)),
    "repeat_interleave with output_size": lambda t, m: torch.repeat_interleave(
        t, t, output_size=15),
    "repeat_interleave by an int": lambda t, m: torch.repeat_interleave(t, 2),
    "torch.tensor on the host": lambda t, m: torch.tensor([1, 2]),
    "a dtype-only .to": lambda t, m: (t.to(torch.int32), t.to(dtype=torch.float32)),
    "a non-blocking .to": lambda t, m: (t.to(t.device, non_blocking=True),
                                        t.to("cpu", torch.int32, True)),
    "shape and numel": lambda t, m: (t.shape[0], t.numel(), len(t)),
}


def _count(call, inference: bool) -> SyncCounter:
    with torch.inference_mode(inference):
        t, m = T.clone(), MASK.clone()
        with SyncCounter(device_type="cpu") as counter:
            call(t, m)
    return counter


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("case", ONE_SYNC)
def test_each_kind_of_sync_counts_once(case, inference):
    call, op = ONE_SYNC[case]
    counter = _count(call, inference)
    assert counter.total == 1, dict(counter.by_op)
    assert op is None or counter.by_op == {op: 1}  # None: the op's name depends on the mode


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("case", NO_SYNC)
def test_device_side_work_counts_nothing(case, inference):
    assert _count(NO_SYNC[case], inference).total == 0


def test_marks_split_counts_into_labelled_segments():
    with SyncCounter(device_type="cpu") as counter:
        int(T[0])                       # step: 1
        for n in (2, 0, 3):             # three rounds
            counter.mark("round")
            for i in range(n):
                T[i].item()
            counter.mark("step")
        T.tolist()                      # step: 1 more
    assert counter.counts_of("round") == [2, 0, 3]
    assert counter.counts == {"step": 2, "round": 5}
    assert counter.by_label() == {"step": {"__int__": 1, "tolist": 1}, "round": {"item": 5}}
    assert counter.by_op == {"__int__": 1, "tolist": 1, "item": 5}


def test_trace_names_the_line_inside_vllm_triforce():
    """Sites are the innermost frame inside the package: here code compiled as if it were
    line 2 of vllm_triforce/probe.py (a file that need not exist)."""
    from pathlib import Path

    import vllm_triforce

    probe = compile("x = 1\nint(t[0]); t.tolist()\n",
                    str(Path(vllm_triforce.__file__).parent / "probe.py"), "exec")
    with SyncCounter(device_type="cpu", trace=True) as counter:
        int(T[0])  # from the test: outside the package
        counter.mark("round")
        exec(probe, {"t": T})  # noqa: S102 -- a frame "inside" the package
    assert counter.sites["step"] == {"(outside vllm_triforce)": 1}
    assert counter.sites["round"] == {"vllm_triforce/probe.py:2 (<module>)": 2}


def test_wrappers_are_restored_and_other_threads_are_not_counted():
    import threading

    originals = (torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.to, torch.tensor,
                 torch.cuda.synchronize)
    with SyncCounter(device_type="cpu") as counter:
        worker = threading.Thread(target=lambda: T.tolist())
        worker.start()
        worker.join()
    assert counter.total == 0
    assert (torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.to, torch.tensor,
            torch.cuda.synchronize) == originals
    with SyncCounter(device_type="cpu") as again:  # usable again after exit
        T.tolist()
    assert again.total == 1


def test_cuda_counter_ignores_host_tensors():
    """With the device on CUDA, a scalar read of a host tensor is no sync."""
    with SyncCounter(device_type="cuda") as counter:
        int(T[0]), T.tolist(), T.nonzero(), T[MASK], T.to("cpu")
    assert counter.total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_syncs_count_once_and_strict_raises():
    t = torch.arange(6, device="cuda")
    with SyncCounter() as counter:
        int(t[0]), t.tolist(), t.cpu(), t[t > 2], torch.tensor([1], device="cuda")
        t.to("cpu")  # `_to_copy(cuda->cpu)`
    assert counter.total == 6, dict(counter.by_op)
    with pytest.raises(RuntimeError), SyncCounter(strict=True):
        int(t[0])


def test_syncs_module_does_not_import_vllm():
    code = ("import sys, vllm_triforce.tools.bench.syncs; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]")
    subprocess.run([sys.executable, "-c", code], check=True)
