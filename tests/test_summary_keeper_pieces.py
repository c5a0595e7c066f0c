"""SummaryKeeper.committed_tokens: its pieces, by array operations, are what the spans
(owner, first position, count) give token by token (`runs_by_token`, the reference here),
whether a pass is one piece (every decode step) or cut into several (`token_pieces`: a
long prefill)."""

import types

import numpy as np
import torch

from vllm_triforce.core.summaries import token_pieces
from vllm_triforce.engine.summary_keeper import SummaryKeeper


def runs_by_token(spans, block_size: int):
    """The reference, token by token: (positions, owners, run_of_token, num_runs) of spans
    (owner, first position, count), each span one request's new tokens in order, one run
    per block a span touches."""
    positions, owners, runs, num_runs = [], [], [], 0
    for owner, start, count in spans:
        first_block = start // block_size
        positions += range(start, start + count)
        owners += [owner] * count
        runs += [num_runs + p // block_size - first_block for p in range(start, start + count)]
        num_runs += (start + count - 1) // block_size - first_block + 1
    return positions, owners, runs, num_runs


def test_runs_by_token_example():
    assert runs_by_token([(0, 6, 3), (1, 0, 2)], 4) == ([6, 7, 8, 0, 1], [0, 0, 0, 1, 1],
                                                        [0, 0, 1, 2, 2], 3)


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


def test_pieces_equal_the_token_by_token_reference():
    rng = np.random.default_rng(0)
    for trial in range(40):
        bs = int(rng.choice([1, 4, 16]))
        batch = _batch(rng, num_reqs=int(rng.integers(1, 40)), block_size=bs)
        rows = sorted(rng.choice(len(batch.q_lens), size=len(batch.q_lens) // 2 + 1,
                                 replace=False).tolist())
        spans = [(r, batch.verify_start[r], batch.q_lens[r] - batch.num_rejected[r])
                 for r in rows if batch.q_lens[r] > batch.num_rejected[r]]
        for limit in (10**6, 1, 3, 2 * bs, 7):  # one piece, then cut several ways
            pieces = list(_keeper(bs, limit).committed_tokens(batch, rows))
            expected = list(token_pieces(spans, limit, bs))
            assert len(pieces) == len(expected), (trial, limit)
            for (pass_rows, block_ids, offsets, (runs, num_runs)), piece in zip(pieces,
                                                                               expected):
                positions, owners, ref_runs, ref_num_runs = runs_by_token(piece, bs)
                assert pass_rows.tolist() == [
                    batch.query_start_loc[r] + p - batch.verify_start[r]
                    for r, p in zip(owners, positions)], (trial, limit)
                assert block_ids.tolist() == [batch.block_table[r, p // bs].item()
                                              for r, p in zip(owners, positions)]
                assert offsets.tolist() == [p % bs for p in positions]
                assert runs.tolist() == ref_runs and num_runs == ref_num_runs, (trial, limit)


def test_one_piece_on_a_worked_example():
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


class _Recorded:
    """A SummaryKeeper's summaries and reads as far as `set_full_blocks` uses them: the
    physical ids of the blocks it sets, in order, and the requests whose tokens it read."""

    num_layers, num_kv_heads, head_dim, chunk_bytes = 1, 1, 1, None

    def __init__(self):
        self.set_ids, self.tokens_read = [], []

    def write_blocks(self, ids, _reads):
        self.set_ids += ids.tolist()


def test_lazy_summaries_read_only_the_blocks_new_to_a_request():
    """`set_full_blocks` over one request, block size 4: it sets its full blocks once;
    a step with no new full block reads nothing of it; a new block is set alone; after a
    resume from preemption (vLLM gives the request a new list of blocks) every full block
    is set again, at its new physical ids, though the count did not change."""
    from vllm_triforce.engine.state import RequestState

    recorded = _Recorded()
    keeper = _keeper(4, 10**6)
    keeper._summarised, keeper.summaries = {}, recorded
    keeper.selector = types.SimpleNamespace(keys=None)  # the cache reader
    keeper.block_reads = lambda _reader, ids: None
    keeper.stats = types.SimpleNamespace(add=lambda **_: None)
    state = RequestState()
    request = types.SimpleNamespace(block_ids=([10, 11, 12],))

    def step(committed: int):
        def tokens(row, start, end):  # prompt embeddings: content keys unknown
            recorded.tokens_read.append((start, end))
            return None
        batch = types.SimpleNamespace(
            committed=[committed], requests=[request], committed_block_tokens=tokens,
            block_table=torch.tensor([request.block_ids[0] + [-1]], dtype=torch.int32))
        before = len(recorded.set_ids)
        keeper.set_full_blocks(batch, [state], [0])
        return recorded.set_ids[before:]

    assert step(9) == [10, 11]
    reads = len(recorded.tokens_read)
    assert step(11) == [] and len(recorded.tokens_read) == reads  # passed over unread
    request.block_ids[0].append(13)  # vLLM appends a running request's new blocks
    assert step(12) == [12]
    assert step(13) == []
    request.block_ids = ([20, 21, 22, 23],)  # resumed: recomputed into new blocks
    assert step(13) == [20, 21, 22]
