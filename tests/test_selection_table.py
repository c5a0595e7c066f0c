"""engine/selections.SelectionTable: each live request's selection, shortlist row and drafts
handed, at its row; written and read for many requests at once, grown as rows are."""

import numpy as np
import torch

from vllm_triforce.core.blocks import PAD
from vllm_triforce.engine.selections import SelectionTable

LAYERS, MAX_SELECTED = 2, 3


def selection(first: int, n: int) -> torch.Tensor:
    """[n, LAYERS, MAX_SELECTED] int64 logical blocks, distinct per request."""
    return torch.arange(first, first + n * LAYERS * MAX_SELECTED).view(n, LAYERS, MAX_SELECTED)


def test_rows_written_and_read_at_once_and_kept_as_the_table_grows():
    table = SelectionTable(LAYERS, MAX_SELECTED, torch.device("cpu"), capacity=2)
    rows = np.array([1, 0])
    table.record(rows, torch.from_numpy(rows), selection(0, 2), np.array([3, 2]),
                 np.array([7, 5]))
    far = np.array([9])  # past the capacity: the table grows, rows 0 and 1 stay
    table.record(far, torch.from_numpy(far), selection(100, 1), np.array([1]), np.array([4]))
    assert table.logical.shape[0] >= 10 and table.logical.dtype == torch.int32
    got = table.of(torch.tensor([0, 1, 9]))
    assert torch.equal(got.long(), torch.stack([selection(0, 2)[1], selection(0, 2)[0],
                                                selection(100, 1)[0]]))
    num_selected, tail_start = table.sizes(np.array([0, 1, 9]))
    assert num_selected.tolist() == [2, 3, 1] and tail_start.tolist() == [5, 7, 4]
    assert (table.logical[2:9] == PAD).all()  # rows never written hold no block


def test_shortlist_rows_and_handed_drafts_by_row():
    table = SelectionTable(LAYERS, MAX_SELECTED, torch.device("cpu"), capacity=4)
    table.keep_shortlist(np.array([3, 1]), step=5)
    assert table.shortlist_row[[3, 1]].tolist() == [0, 1]
    assert table.shortlist_step[[3, 1, 0]].tolist() == [5, 5, -1]
    table.record_handed(np.array([3, 1, 2]), np.array([6, 0, 4]))
    assert table.take_handed(np.array([1, 2, 3])).tolist() == [0, 4, 6]
    assert table.take_handed(np.array([1, 2, 3])).tolist() == [0, 0, 0]  # read once
    table.record_handed(np.array([3]), np.array([2]))
    table.release([3])  # the request left: a new one at its row holds nothing
    assert table.take_handed(np.array([3])).tolist() == [0]
    assert table.shortlist_step[3] == -1
