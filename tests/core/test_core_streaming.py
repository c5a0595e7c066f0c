"""The small draft's sink + window table and its position scheme."""

import random

import pytest
import torch

from vllm_triforce.core.streaming import DraftWindow, draft_positions, needs_rebase


def ref_table(table_row, seq_len, bs, num_sink, num_window):
    num_blocks = -(-seq_len // bs)
    blocks = list(range(min(num_sink, num_blocks)))
    blocks += list(range(max(num_sink, num_blocks - num_window), num_blocks))
    tokens = sum(min(bs, seq_len - b * bs) for b in blocks)
    return [int(table_row[b]) for b in blocks], tokens, blocks


def test_hand_worked_docstring_example():
    w = DraftWindow(num_sink_blocks=1, num_window_blocks=4, block_size=32, max_draft_position=256)
    assert not w.needs_rebase(255, 0) and w.needs_rebase(256, 0)
    start, offset = w.rebase(256)
    assert start == 128 and offset == 96
    pos = draft_positions(torch.tensor([0, 31, 128, 255, 256]), torch.tensor(96), w.sink_tokens)
    assert pos.tolist() == [0, 31, 32, 159, 160]
    assert [w.position(p, 96) for p in (0, 31, 128, 255, 256)] == [0, 31, 32, 159, 160]
    assert not w.needs_rebase(351, offset) and w.needs_rebase(352, offset)


def test_table_matches_reference():
    bs, num_sink, num_window = 4, 2, 3
    w = DraftWindow(num_sink_blocks=num_sink, num_window_blocks=num_window, block_size=bs,
                    max_draft_position=64, lookahead=4)
    seq_lens = list(range(1, 40))
    table = torch.arange(100, 100 + 12, dtype=torch.int32)
    columns, lens = w.table_columns(seq_lens, max_blocks=12)
    assert columns.shape == (len(seq_lens), num_sink + num_window)
    for r, n in enumerate(seq_lens):
        row, tokens, _ = ref_table(table, n, bs, num_sink, num_window)
        assert [int(table[c]) for c in columns[r, :len(row)]] == row
        assert (columns[r, len(row):] == -1).all()
        assert int(lens[r]) == tokens
        if n <= (num_sink + num_window) * bs:
            assert int(lens[r]) == n  # short: the full table
    assert [w.window_start(n) for n in (1, 8, 9, 20, 21)] == [8, 8, 8, 8, 12]


@pytest.mark.parametrize("seed", range(3))
def test_long_request_never_exceeds_draft_context(seed):
    """Grow a request to 5000 tokens in passes of 1..lookahead tokens, rebasing when told.
    Track the offset each token's KV was written with: every key the draft attends to
    must carry the current offset (consistent distances) and every position must stay
    below the draft's limit."""
    rng = random.Random(seed)
    bs, limit, lookahead = 16, 256, 7
    w = DraftWindow(num_sink_blocks=1, num_window_blocks=6, block_size=bs,
                    max_draft_position=limit, lookahead=lookahead)
    written = []  # offset each token was written with
    seq_len, rebases, offset = 0, 0, 0
    table = torch.arange(400, dtype=torch.int32)
    while seq_len < 5000:
        step = rng.randint(1, lookahead)
        if w.needs_rebase(seq_len + step - 1, offset):
            start, offset = w.rebase(seq_len)
            written[max(start, w.sink_tokens):] = [offset] * (seq_len - max(start, w.sink_tokens))
            rebases += 1
        written += [offset] * step
        seq_len += step
        _, lens = w.table_columns([seq_len], max_blocks=400)
        _, _, blocks = ref_table(table, seq_len, bs, 1, 6)
        attended = [t for b in blocks for t in range(b * bs, min((b + 1) * bs, seq_len))]
        assert len(attended) == int(lens[0])
        positions = [w.position(t, offset) for t in attended]
        assert max(positions) < limit and min(positions) >= 0
        assert all(written[t] == offset for t in attended if t >= w.sink_tokens)
    assert rebases >= 5000 // limit


def test_batched_helpers_and_validation():
    flags = needs_rebase(torch.tensor([10, 300, 300]), torch.tensor([0, 0, 100]), 16, 256)
    assert flags.tolist() == [False, True, False]
    pos = draft_positions(torch.tensor([[3, 20], [3, 200]]), torch.tensor([[0], [150]]), 16)
    assert pos.tolist() == [[3, 20], [3, 50]]
    with pytest.raises(ValueError, match="does not fit"):
        DraftWindow(num_sink_blocks=1, num_window_blocks=7, block_size=32, max_draft_position=256)


def test_host_helpers_equal_the_tensor_functions():
    """DraftWindow's per-request Python helpers (the engine's host side) give what the
    batched tensor functions give; its window starts where its table's window does."""
    w = DraftWindow(num_sink_blocks=1, num_window_blocks=3, block_size=4, max_draft_position=40,
                    lookahead=4)
    seq_lens = list(range(1, 120))
    columns, _ = w.table_columns(seq_lens, max_blocks=30)
    for n, row in zip(seq_lens, columns.tolist()):
        window = [c for c in row[1:] if c >= 0]  # past the one sink block
        assert w.window_start(n) == (window[0] * 4 if window else 4)
        for offset in (0, 8, 20):
            assert w.position(n, offset) == int(draft_positions(torch.tensor(n), offset, 4))
            assert w.needs_rebase(n, offset) == bool(
                needs_rebase(torch.tensor([n]), torch.tensor([offset]), 4, 40)[0])


def test_table_columns_stop_at_the_block_tables_width():
    """A request longer than its block table holds (a table cut to a pass's width) reads
    no column past it; the docstring's example."""
    w = DraftWindow(num_sink_blocks=2, num_window_blocks=3, block_size=4, max_draft_position=64,
                    lookahead=4)
    columns, compact = w.table_columns([40, 48], max_blocks=11)  # 10 and 12 blocks
    assert columns.tolist() == [[0, 1, 7, 8, 9], [0, 1, 9, 10, -1]]
    assert compact.tolist() == [8 + 12, 8 + 12]
    small = DraftWindow(num_sink_blocks=1, num_window_blocks=2, block_size=4,
                        max_draft_position=40, lookahead=4)
    cols, lens = small.table_columns([13, 6], max_blocks=8)
    assert cols.tolist() == [[0, 2, 3], [0, 1, -1]] and lens.tolist() == [9, 6]
