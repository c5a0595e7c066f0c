"""Moving values between the host and the device without stalling the device.

The rule the engine follows: host values are Python, device values are tensors, because on
a GPU every read of a device value makes the host wait for the device (a sync).
What the host decides (positions, row indices, lengths) is built as Python lists or numpy
arrays and sent with `to_device`: one copy, non-blocking, from pinned memory on CUDA, so
the host never waits for the device. What the host must learn from the device comes
back in one blocking copy: once per step with `to_host` (what vLLM's step decided,
engine/batch.py) and once per middle round with one `.tolist()` of what decides the next
round, its tokens and accepted counts packed on the device first (engine/middle.py).
tests/test_syncs.py counts a step's syncs and holds them to one per middle round and at
most three outside the rounds.

vLLM's runner does the same with its `CpuGpuBuffer`s (vllm/v1/utils.py, 0.32.0): host
numpy arrays copied with `non_blocking=True` from pinned memory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def to_device(device: torch.device, *lists: Sequence[int] | np.ndarray) -> list[torch.Tensor]:
    """Int lists or arrays -> int64 tensors on `device`, in ONE non-blocking copy, packed
    by numpy (no Python loop over the values).

    Example: to_device(dev, [0, 2], [7]) -> [tensor([0, 2]), tensor([7])] on dev. On a
    CUDA device the packed host tensor is pinned, so the copy is asynchronous; the caching
    host allocator keeps it alive until the copy has run. On the CPU nothing is copied."""
    arrays = [np.asarray(values, dtype=np.int64).reshape(-1) for values in lists]
    host = torch.from_numpy(np.concatenate(arrays))
    if _pinned(device):
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([a.size for a in arrays]))


def to_host(*tensors: torch.Tensor) -> list[list]:
    """Device tensors -> Python lists (each flattened), in ONE blocking copy: packed as
    float64 (exact for ids and counts below 2**53 and for float32 values) and read back as
    Python ints where the tensor held integers or bools."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    flat = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
    out, start = [], 0
    for t in tensors:
        values = flat[start:start + t.numel()]
        if not t.dtype.is_floating_point:
            values = values.astype(np.int64)
        out.append(values.tolist())
        start += t.numel()
    return out


def _pinned(device: torch.device | str) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda"
