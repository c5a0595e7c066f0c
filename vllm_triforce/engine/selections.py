"""Every live request's retrieval selection, kept by its row: what a middle pass lays its
per-layer tables out from (engine/retrieval_level.py `RetrievalStep.forward`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from vllm_triforce.core.blocks import PAD


class SelectionTable:
    """Each live request's last selection at its row (the row core.refresh.RefreshPolicy
    hands it, `RequestState.refresh`): on the device its logical blocks per layer, sinks
    and selected blocks ascending, PAD after (`logical`, [rows, num_layers, max_selected]
    int32); on the host how many (`num_selected`) and the first block of its contiguous
    tail (`tail_start`); which row of a step-start shortlist it holds (`shortlist_row`),
    with the number of the step that made it (`shortlist_step`, -1: none); and the
    drafts it was handed last step (`handed`: what vLLM's next pass verifies, read and
    cleared when that step begins). A re-selection writes its requests' rows with one
    index, and a pass reads its requests' with one: no tensor, list or field per
    request.

    A selection is read only after its request's first selection wrote it (a request
    that never selected is due one, `RefreshPolicy.due_at_start`); `release` clears what
    a new request at a freed row could read first: the drafts handed and the shortlist's
    step. The table grows, by doubling, as the refresh policy's rows do (max_num_seqs of
    them while no request is preempted): 4 B per layer and selected block, at most 32 KiB
    a request for Llama-3.1-8B with a 4,096-token budget of 16-token blocks (32 layers x
    256 blocks x 4 B). It is not part of the memory plan's reservation."""

    def __init__(self, num_layers: int, max_selected: int, device: torch.device,
                 capacity: int = 16):
        self.logical = torch.full((capacity, num_layers, max_selected), PAD,
                                  dtype=torch.int32, device=device)
        self.num_selected = np.zeros(capacity, dtype=np.int64)
        self.tail_start = np.zeros(capacity, dtype=np.int64)
        self.shortlist_row = np.zeros(capacity, dtype=np.int64)
        self.shortlist_step = np.full(capacity, -1, dtype=np.int64)
        self.handed = np.zeros(capacity, dtype=np.int64)

    def record(self, rows: np.ndarray, rows_on_device: Tensor, logical: Tensor,
               num_selected: np.ndarray, tail_start: np.ndarray) -> None:
        """Requests at `rows` (host, and the same on the device) selected `logical`
        [len(rows), num_layers, max_selected] (a Selection's `logical_blocks`), with the
        host's sizes of each (core/blocks.selection_sizes)."""
        self._fit(int(rows.max()) + 1)
        self.logical[rows_on_device] = logical.to(torch.int32)
        self.num_selected[rows] = num_selected
        self.tail_start[rows] = tail_start

    def keep_shortlist(self, rows: np.ndarray, step: int) -> None:
        """Requests at `rows` hold rows 0, 1, ... of the shortlist step `step` made."""
        self.shortlist_row[rows] = np.arange(rows.shape[0])
        self.shortlist_step[rows] = step

    def record_handed(self, rows: np.ndarray, num_drafts: np.ndarray) -> None:
        """Requests at `rows` were handed num_drafts[i] drafts this step."""
        self._fit(int(rows.max(initial=-1)) + 1)
        self.handed[rows] = num_drafts

    def take_handed(self, rows: np.ndarray) -> np.ndarray:
        """[n] the drafts the requests at `rows` were handed last step, read once (the
        rows go back to 0)."""
        self._fit(int(rows.max(initial=-1)) + 1)
        handed = self.handed[rows]
        self.handed[rows[handed > 0]] = 0
        return handed

    def release(self, rows) -> None:
        """The requests at `rows` are gone: a new request there holds no drafts and no
        shortlist."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[rows < self.handed.shape[0]]
        self.handed[rows] = 0
        self.shortlist_step[rows] = -1

    def of(self, rows_on_device: Tensor) -> Tensor:
        """[n, num_layers, max_selected] the selections of the requests at those rows."""
        return self.logical[rows_on_device]

    def sizes(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(num_selected, tail_start) [n] of the requests at `rows`."""
        return self.num_selected[rows], self.tail_start[rows]

    def _fit(self, rows: int) -> None:
        """Room for `rows` rows at least (doubling)."""
        old = self.num_selected.shape[0]
        if rows <= old:
            return
        capacity = max(rows, 2 * old)
        grown = self.logical.new_full((capacity, *self.logical.shape[1:]), PAD)
        grown[:old] = self.logical
        self.logical = grown
        for name, fill in (("num_selected", 0), ("tail_start", 0), ("shortlist_row", 0),
                           ("shortlist_step", -1), ("handed", 0)):
            array = np.full(capacity, fill, dtype=np.int64)
            array[:old] = getattr(self, name)
            setattr(self, name, array)
