"""One helper for the core's functions, which take tensors from the engine (already on the
device) and from tests and benchmarks (anywhere)."""

from __future__ import annotations

import torch


def on_device(t: torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (and in `dtype`), copied across devices only if it lives elsewhere:
    a tensor already there is not handed to `Tensor.to(device)`, so a caller's host-side
    copy, if any, is the only one the sync counter (vllm_triforce/tools/bench/syncs.py) sees."""
    if t.device != torch.device(device):
        return t.to(device, dtype)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
