"""BlockSummaries: incremental sums == brute-force means of the committed keys."""

import pytest
import torch

from core_toys import make_pool, write_pass
from vllm_triforce.core.summaries import BlockSummaries, committed_runs


def mean_keys(summaries, layer=None):
    """[L, num_blocks, H, D] (or [num_blocks, H, D] for one layer); empty blocks -> 0."""
    sums = summaries.sums if layer is None else summaries.sums[layer]
    return sums / summaries.counts.clamp(min=1).to(sums.dtype)[:, None, None]


def is_full(summaries, block_ids):
    """bool, same shape as block_ids: the block holds block_size committed tokens."""
    return summaries.counts[block_ids] == summaries.block_size


def test_hand_worked_mean():
    s = BlockSummaries(num_layers=1, num_blocks=2, num_kv_heads=1, head_dim=1, block_size=2)
    keys = [torch.tensor([[1.0], [3.0], [100.0]])]  # row 2 is speculative
    s.add_committed(keys, rows=torch.tensor([0, 1]), block_ids=torch.tensor([1, 1]),
                    offsets=torch.tensor([0, 1]))
    assert mean_keys(s, 0)[1].item() == 2.0
    assert s.counts.tolist() == [0, 2]
    assert is_full(s, torch.tensor([0, 1])).tolist() == [False, True]


def test_incremental_equals_brute_force():
    lengths = [23, 8, 3]
    block_size = 4
    summaries, table, keys = make_pool(lengths, block_size=block_size, chunk=5)
    means = mean_keys(summaries)  # [L, num_blocks, H, D]
    for r, n in enumerate(lengths):
        for b in range(-(-n // block_size)):
            phys = int(table[r, b])
            block_keys = keys[r][:, b * block_size:(b + 1) * block_size]  # [L, <=bs, H, D]
            torch.testing.assert_close(means[:, phys], block_keys.mean(1))
            assert int(summaries.counts[phys]) == block_keys.shape[1]
            stored = summaries.keys[:, phys, :block_keys.shape[1]]
            torch.testing.assert_close(stored, block_keys)
            # per-channel bounds of the committed keys only (speculative rows are 1e3-scale)
            assert torch.equal(summaries.mins[:, phys], block_keys.amin(1))
            assert torch.equal(summaries.maxs[:, phys], block_keys.amax(1))
    # a gather of mean keys by rows of the stores (`layer_rows`, `rows_of`: what the
    # summary policies read): one block list per layer, [R, L, B]
    blocks = table.long()[:, None].expand(-1, summaries.num_layers, -1)
    sums = summaries.rows_of(summaries.sums, summaries.layer_rows(blocks))  # [R, L, B, H, D]
    counts = summaries.counts[blocks].clamp(min=1)  # [R, L, B]
    gathered = means[:, table.long()].transpose(0, 1)  # [R, L, B, H, D]
    torch.testing.assert_close(sums / counts[..., None, None], gathered)


def test_reused_block_starts_over():
    gen = torch.Generator().manual_seed(1)
    s = BlockSummaries(num_layers=2, num_blocks=3, num_kv_heads=2, head_dim=4, block_size=4,
                       keep_keys=True, keep_bounds=True)
    table = torch.tensor([2, 0])
    old = torch.randn(2, 7, 2, 4, generator=gen)
    write_pass(s, old, table, 0, 4, gen)  # block 2 full, block 0 has 3 tokens
    new = torch.randn(2, 2, 2, 4, generator=gen)
    write_pass(s, new, torch.tensor([0]), 0, 4, gen)  # block 0 freed and reused from offset 0
    torch.testing.assert_close(mean_keys(s)[:, 0], new.mean(1))
    assert s.counts.tolist() == [2, 0, 4]
    assert torch.all(s.keys[:, 0, 2:] == 0)  # the old request's keys are gone
    assert torch.equal(s.mins[:, 0], new.amin(1)) and torch.equal(s.maxs[:, 0], new.amax(1))
    assert torch.all(s.mins[:, 1] == float("inf")) and torch.all(s.maxs[:, 1] == float("-inf"))
    torch.testing.assert_close(mean_keys(s)[:, 2], old[:, :4].mean(1))


def test_accepts_three_dim_keys_and_counts_memory():
    s = BlockSummaries(num_layers=1, num_blocks=4, num_kv_heads=2, head_dim=3, block_size=2)
    keys = [torch.arange(12.0).view(2, 2, 3)]  # [T, H, D]
    s.add_committed(keys, torch.tensor([0, 1]), torch.tensor([3, 3]), torch.tensor([0, 1]))
    torch.testing.assert_close(mean_keys(s, 0)[3], keys[0].mean(0))
    assert s.nbytes() == 1 * 4 * 2 * 3 * 4 + 4 * 4
    with_keys = BlockSummaries(1, 4, 2, 3, 2, keep_keys=True)
    assert with_keys.nbytes() == s.nbytes() + 1 * 4 * 2 * 2 * 3 * 4
    with_bounds = BlockSummaries(1, 4, 2, 3, 2, keep_bounds=True)
    assert with_bounds.nbytes() == s.nbytes() + 2 * 1 * 4 * 2 * 3 * 4  # min and max
    assert s.mins is None and s.maxs is None


def test_hand_worked_bounds():
    s = BlockSummaries(num_layers=1, num_blocks=1, num_kv_heads=1, head_dim=2, block_size=4,
                       keep_bounds=True)
    keys = [torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]])]
    s.add_committed(keys, torch.arange(3), torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert s.mins[0, 0, 0].tolist() == [-1.0, -2.0]
    assert s.maxs[0, 0, 0].tolist() == [3.0, 4.0]
    mins, maxs = s.bounds(0, torch.tensor([[0]]))  # [R, B, H, D]
    assert mins.shape == (1, 1, 1, 2) and maxs[0, 0, 0].tolist() == [3.0, 4.0]


def test_square_deviations_combine_pass_by_pass():
    """Keys arriving in passes of 1-3 tokens, a block reused after a reset: deviations() /
    count is each channel's population variance of the block's committed keys."""
    gen = torch.Generator().manual_seed(5)
    s = BlockSummaries(2, 3, 2, 4, 4, keep_variance=True)
    keys = 3 + torch.randn(2, 12, 2, 4, generator=gen)  # [L, T, H, D], offset: not centred
    blocks = torch.tensor([0] * 4 + [2] * 4 + [1] * 4)
    for lo, hi in ((0, 1), (1, 4), (4, 6), (6, 7), (7, 10), (10, 12)):
        pos = torch.arange(lo, hi)
        s.add_committed([keys[l, lo:hi] for l in range(2)], torch.arange(hi - lo),
                        blocks[pos], pos % 4)
    for block, first in ((0, 0), (2, 4), (1, 8)):
        expected = keys[:, first:first + 4].var(1, unbiased=False)  # [L, H, D]
        got = s.deviations()[:, block] / s.counts[block]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # block 2 reused: its first token at offset 0 resets it
    s.add_committed([keys[l, :1] for l in range(2)], torch.arange(1), torch.tensor([2]),
                    torch.tensor([0]))
    assert s.counts[2] == 1 and torch.all(s.deviations()[:, 2] == 0)
    assert s.nbytes() == BlockSummaries(2, 3, 2, 4, 4).nbytes() + 2 * 3 * 2 * 4 * 4


def test_runs_known_on_the_host_fold_like_unique():
    """The engine passes each committed token's run (one per block, known on the host, so
    nothing syncs); the result equals the `unique` path's, reuse of a block included."""
    gen = torch.Generator().manual_seed(3)
    kinds = dict(keep_keys=True, keep_bounds=True, keep_variance=True)
    a = BlockSummaries(num_layers=2, num_blocks=6, num_kv_heads=2, head_dim=3, block_size=4,
                       **kinds)
    b = BlockSummaries(num_layers=2, num_blocks=6, num_kv_heads=2, head_dim=3, block_size=4,
                       **kinds)
    # two requests: positions 2..9 in blocks [5, 1, 3] and 0..2 in block [4]; then block 1
    # is freed and reused by a new request starting at offset 0
    steps = [([5, 5, 1, 1, 1, 1, 3, 3, 4, 4, 4], [2, 3, 0, 1, 2, 3, 0, 1, 0, 1, 2],
              [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3], 4),
             ([1, 1, 3], [0, 1, 2], [0, 0, 1], 2)]
    for block_ids, offsets, runs, num_runs in steps:
        keys = [torch.randn(len(block_ids), 6, generator=gen) for _ in range(2)]
        rows = torch.arange(len(block_ids))
        a.add_committed(keys, rows, torch.tensor(block_ids), torch.tensor(offsets))
        b.add_committed(keys, rows, torch.tensor(block_ids), torch.tensor(offsets),
                        runs=(torch.tensor(runs), num_runs))
    for store in ("sums", "counts", "keys", "mins", "maxs", "square_deviations"):
        assert torch.allclose(getattr(a, store), getattr(b, store)), store
    assert b.counts[1].item() == 2  # the reused block started over


def test_committed_runs_on_the_host():
    # the spans of the test above: request 0 commits positions 2..9, request 1 positions 0..2
    positions, owners, runs, num_runs = committed_runs([0, 1], [2, 0], [8, 3], 4)
    assert positions.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert owners.tolist() == [0] * 8 + [1] * 3
    assert runs.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3] and num_runs == 4
    positions, owners, runs, num_runs = committed_runs([], [], [], 4)  # nothing committed
    assert positions.size == owners.size == runs.size == num_runs == 0


def test_set_blocks_equals_committing_every_offset():
    """Lazy summaries (engine/retrieval_level.py): full blocks' summaries set at once from
    their keys [L, n, H, bs, D] equal the ones committing its tokens over several passes gives;
    setting a block twice changes nothing; a block holding stale state is replaced."""
    gen = torch.Generator().manual_seed(5)
    kinds = dict(keep_keys=True, keep_bounds=True, keep_variance=True)
    L, N, H, D, BS = 2, 6, 2, 3, 4
    eager = BlockSummaries(num_layers=L, num_blocks=N, num_kv_heads=H, head_dim=D,
                           block_size=BS, **kinds)
    lazy = BlockSummaries(num_layers=L, num_blocks=N, num_kv_heads=H, head_dim=D,
                          block_size=BS, **kinds)
    blocks = [4, 1, 3]  # a request's blocks in logical order, 12 tokens
    keys = torch.randn(L, len(blocks) * BS, H, D, generator=gen)
    positions = torch.arange(len(blocks) * BS)
    physical = torch.tensor(blocks)[positions // BS]
    for lo, hi in ((0, 5), (5, 6), (6, 12)):  # three passes, runs crossing block borders
        eager.add_committed([keys[l, lo:hi].flatten(1) for l in range(L)], positions[lo:hi] - lo,
                            physical[lo:hi], positions[lo:hi] % BS)
    lazy.add_committed([torch.randn(2, H * D, generator=gen)] * L, torch.arange(2),
                       torch.tensor([1, 1]), torch.tensor([0, 1]))  # stale: a block's last owner
    by_block = keys.unflatten(1, (len(blocks), BS)).transpose(2, 3)  # [L, n, H, BS, D]
    for _ in range(2):  # twice: idempotent
        lazy.set_blocks(torch.tensor(blocks), by_block)
    for store in ("sums", "mins", "maxs", "keys"):
        assert torch.allclose(getattr(lazy, store), getattr(eager, store), atol=1e-6), store
    assert torch.equal(lazy.counts, eager.counts) and lazy.counts[blocks].tolist() == [BS] * 3
    assert torch.allclose(lazy.square_deviations, eager.square_deviations, atol=1e-5)


def test_variance_width_takes_bands_of_whole_rotation_pairs():
    from vllm_triforce.core.summaries import variance_dtype, variance_width
    assert [variance_width(d, True) for d in (128, 64, 80, 8, 12)] == [8, 8, 4, 2, 1]
    assert variance_width(128, False) == 128
    with pytest.raises(ValueError, match="even head size"):
        variance_width(7, True)
    assert variance_dtype(torch.bfloat16, True) == torch.bfloat16
    assert variance_dtype(torch.float16, True) == torch.float32  # a band's sum may overflow
    assert variance_dtype(torch.bfloat16, False) == torch.float32


def test_compact_variance_is_the_per_channel_one_summed_over_bands():
    """compact_variance keeps, per band (head_dim 8: channels 0, 1, 4, 5 and 2, 3, 6, 7),
    the sum of the per-channel square deviations: pass by pass (a block reused after a
    reset), set at once from full blocks, and as `with_compact_variance` folds a
    per-channel store; in the summaries' dtype, 2 values per KV head."""
    gen = torch.Generator().manual_seed(7)
    L, N, H, D, BS = 2, 4, 2, 8, 4
    per_channel = BlockSummaries(L, N, H, D, BS, keep_variance=True)
    compact = BlockSummaries(L, N, H, D, BS, keep_variance=True, compact_variance=True)
    keys = 3 + torch.randn(L, 14, H, D, generator=gen)
    blocks = torch.tensor([2] * 4 + [0] * 4 + [3] * 4 + [2] * 2)  # block 2 reused at 12
    offsets = torch.tensor(list(range(4)) * 3 + [0, 1])
    for lo, hi in ((0, 1), (1, 5), (5, 10), (10, 12), (12, 14)):
        for s in (per_channel, compact):
            s.add_committed([keys[l, lo:hi].flatten(1) for l in range(L)],
                            torch.arange(hi - lo), blocks[lo:hi], offsets[lo:hi])
    folded = torch.stack([per_channel.deviations()[..., band].sum(-1)
                          for band in ([0, 1, 4, 5], [2, 3, 6, 7])], dim=-1)
    assert compact.deviations().shape == (L, N, H, 2)
    torch.testing.assert_close(compact.deviations(), folded)
    torch.testing.assert_close(per_channel.with_compact_variance().deviations(), folded)
    # its channel profile: every block's per-channel M2 folded so far, block 2's first
    # four keys too, though the block was reset since
    def m2(block):  # [L, n, H, D] -> [L, H, D]
        return (block - block.mean(1, keepdim=True)).square().sum(1)
    history = sum(m2(keys[:, lo:lo + 4]) for lo in (0, 4, 8, 12))
    torch.testing.assert_close(compact.channel_profile, history)
    profile_bytes = L * H * D * 4
    assert compact.nbytes() == (BlockSummaries(L, N, H, D, BS).nbytes() + L * N * H * 2 * 4
                                + profile_bytes)
    full = keys[:, :12].unflatten(1, (3, BS)).transpose(2, 3)  # [L, 3, H, BS, D]
    for s in (per_channel, compact):
        s.set_blocks(torch.tensor([1, 0, 3]), full)
    torch.testing.assert_close(compact.channel_profile, history + sum(
        m2(keys[:, lo:lo + 4]) for lo in (0, 4, 8)))
    torch.testing.assert_close(compact.deviations()[:, [1, 0, 3]], torch.stack(
        [per_channel.deviations()[:, [1, 0, 3]][..., band].sum(-1)
         for band in ([0, 1, 4, 5], [2, 3, 6, 7])], dim=-1))
    bf16 = BlockSummaries(L, N, H, D, BS, dtype=torch.bfloat16, keep_variance=True,
                          compact_variance=True)
    assert bf16.deviations().dtype == torch.bfloat16
    view = per_channel.with_compact_variance(torch.bfloat16)
    assert view.deviations().dtype == torch.bfloat16 and view.sums is per_channel.sums
