"""SummaryKeeper.committed_tokens: the one-piece path (array operations, every decode step)
gives exactly what the span-by-span path (`token_pieces` + `committed_runs`) gives."""

import types

import numpy as np
import torch

from vllm_triforce.engine.summary_keeper import SummaryKeeper


def _keeper(block_size: int, fold_tokens: int) -> SummaryKeeper:
    keeper = SummaryKeeper.__new__(SummaryKeeper)
    keeper.block_size, keeper.device = block_size, torch.device("cpu")
    keeper.fold_tokens = lambda: fold_tokens
    return keeper


def _batch(rng, num_reqs: int, block_size: int):
    q_lens = rng.integers(1, 7, num_reqs)
    rejected = np.minimum(rng.integers(0, 4, num_reqs), q_lens)  # some commit nothing
    verify_start = rng.integers(0, 5 * block_size, num_reqs)
    return types.SimpleNamespace(
        q_lens=q_lens.tolist(), num_rejected=rejected.tolist(),
        verify_start=verify_start.tolist(),
        query_start_loc=[0, *np.cumsum(q_lens).tolist()],
        block_table=torch.arange(num_reqs * 16, dtype=torch.int32).reshape(num_reqs, 16))


def test_one_piece_equals_the_span_by_span_fold():
    rng = np.random.default_rng(0)
    for trial in range(20):
        batch = _batch(rng, num_reqs=int(rng.integers(1, 40)), block_size=4)
        rows = sorted(rng.choice(len(batch.q_lens), size=len(batch.q_lens) // 2 + 1,
                                 replace=False).tolist())
        whole = list(_keeper(4, 10**6).committed_tokens(batch, rows))  # one piece
        # spans one token at a time never fit one piece: the span-by-span path, then joined
        pieces = list(_keeper(4, 1).committed_tokens(batch, rows))
        if not pieces:
            assert not whole
            continue
        [(pass_rows, block_ids, offsets, (runs, num_runs))] = whole
        assert pass_rows.tolist() == [t for p in pieces for t in p[0].tolist()]
        assert block_ids.tolist() == [t for p in pieces for t in p[1].tolist()]
        assert offsets.tolist() == [t for p in pieces for t in p[2].tolist()]
        # one token per piece: each piece one run; the whole piece numbers a span's blocks
        owners = np.repeat(rows, [max(0, q - r) for q, r in
                                  zip(np.asarray(batch.q_lens)[rows],
                                      np.asarray(batch.num_rejected)[rows])])
        blocks = block_ids.numpy()
        expected = np.cumsum(np.r_[True, (owners[1:] != owners[:-1])
                                   | (blocks[1:] != blocks[:-1])]) - 1
        assert runs.tolist() == expected.tolist() and num_runs == expected[-1] + 1, trial


def test_one_piece_matches_committed_runs_on_a_worked_example():
    # block size 4: request 0 commits positions 6, 7, 8 (two blocks), request 1 positions 0, 1
    batch = types.SimpleNamespace(q_lens=[3, 3], num_rejected=[0, 1], verify_start=[6, 0],
                                  query_start_loc=[0, 3, 6],
                                  block_table=torch.tensor([[10, 11, 12], [20, 21, 22]],
                                                           dtype=torch.int32))
    [(rows, block_ids, offsets, (runs, num_runs))] = list(
        _keeper(4, 100).committed_tokens(batch, range(2)))
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert block_ids.tolist() == [11, 11, 12, 20, 20]
    assert offsets.tolist() == [2, 3, 0, 0, 1]
    assert runs.tolist() == [0, 0, 1, 2, 2] and num_runs == 3


def test_a_pass_folds_to_the_same_summaries_whatever_the_read_chunk():
    """The fold's piece size comes from the memory plan's read chunk (`fold_tokens`), which
    other settings move (round graphs reserve memory): a pass's summaries must not depend
    on it. Pieces cut a request's tokens only where a block ends, so each block's tokens
    of the pass are folded at once: a coded store codes it once and the variance merges
    once, for any piece size of at least a block. Two prefill chunks (one starts
    mid-block) and a decode row, folded in pieces of 20 and of 29 tokens (block size 8):
    the same summaries, bit for bit, coded and float32."""
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.engine.summary_keeper import fold_committed

    bs, layers, heads, dim = 8, 2, 2, 16
    batch = types.SimpleNamespace(
        q_lens=[45, 1, 38], num_rejected=[0, 0, 0], verify_start=[0, 70, 13],
        query_start_loc=[0, 45, 46, 84],
        block_table=torch.arange(3 * 12, dtype=torch.int32).reshape(3, 12))
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(84, heads * dim, generator=gen) * 3 + 1 for _ in range(layers)]
    for coded in (True, False):
        folded = []
        for limit in (20, 29):
            summaries = BlockSummaries(layers, 36, heads, dim, bs, keep_variance=True,
                                       coded=coded)
            pieces = list(_keeper(bs, limit).committed_tokens(batch, range(3)))
            assert len(pieces) >= 3  # the pass is cut
            for piece in pieces:
                fold_committed(summaries, keys, piece)
            folded.append(summaries)
        a, b = folded
        assert torch.equal(a.counts, b.counts)
        for store in ("sums", "square_deviations"):
            x, y = getattr(a, store), getattr(b, store)
            if coded:
                x, y = x.blocks(slice(None)), y.blocks(slice(None))
            assert torch.equal(x, y), (coded, store, (x - y).abs().max())
