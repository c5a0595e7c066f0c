"""Coded block summaries (core/summary_coding.py, `compact_summaries`): what a coded store
holds is the float summaries rounded once per coding, and the retrieval policy scores it
exactly as it scores float summaries holding those rounded values."""

import pytest
import torch

from core_toys import make_pool
from vllm_triforce.core import summary_coding
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.summary_coding import CodedStore, decode, encode, rounded

L, N, H, D, BS = 3, 12, 2, 16, 4


def test_the_log_code_worked_example():
    """The module docstring's row: [8, 2, 0, 1] -> codes [0, 32, 255, 48], read back
    exactly; 3.0 reads back as 8 x 2^(-23/16)."""
    codes, top = encode(torch.tensor([[8.0, 2.0, 0.0, 1.0, 3.0]]), "log8")
    assert codes.tolist() == [[0, 32, 255, 48, 23]] and top.item() == 8.0
    assert decode(codes, top, "log8")[0, :4].tolist() == [8.0, 2.0, 0.0, 1.0]
    assert decode(codes, top, "log8")[0, 4].item() == pytest.approx(8 * 2 ** (-23 / 16))


def test_each_coding_is_within_its_step_of_every_value():
    """fp8 e4m3 scaled so its row's largest magnitude is 448: within 1/16 of the value (3
    mantissa bits) where the scaled value is normal (at least 2^-6), within half the
    subnormals' step (2^-10 scaled) below; log8: within 2.2% of every value above 2^-15.9
    of the row's largest, 0 below; both exact at the row's largest (fp8 up to its scale's
    rounding), and a zero row stays 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[:, :8] *= 1e-6  # far below the row's top: fp8's subnormals, log8's zero
    top = x.abs().amax(-1, keepdim=True)
    fp8 = rounded(x, "fp8")
    normal = x.abs() / top * 448 >= 2**-6
    assert ((fp8 - x).abs() <= x.abs() / 16)[normal].all()
    assert ((fp8 - x).abs() <= top / 448 * 2**-10)[~normal].all() and (~normal).any()
    squares = x.square()
    log8 = rounded(squares, "log8")
    kept = squares >= squares.amax(-1, keepdim=True) * 2**-15.9
    assert ((log8 - squares).abs() <= 0.022 * squares)[kept].all()
    assert (log8[~kept] == 0).all()
    rows = torch.arange(64)
    torch.testing.assert_close(fp8.abs()[rows, x.abs().argmax(-1)], top[:, 0])
    assert torch.equal(log8[rows, squares.argmax(-1)], squares.amax(-1))
    assert (rounded(torch.zeros(2, 8), "fp8") == 0).all()
    assert (rounded(torch.zeros(2, 8), "log8") == 0).all()


def test_a_coded_store_reads_back_what_it_was_written_by_every_read():
    """write, then gather, blocks (a slice) and rows (of the [L x N] flattening) all read
    the same rounded values; an unwritten block reads 0; one byte a value and a float32
    scale a row."""
    gen = torch.Generator().manual_seed(1)
    for coding in ("fp8", "log8"):
        store = CodedStore(coding, L, N, H, D)
        assert (store.blocks(slice(None)) == 0).all()
        values = torch.rand(L, 3, H, D, generator=gen) + 0.1
        ids = torch.tensor([7, 2, 9])
        store.write(ids, values)
        want = rounded(values, coding)
        assert torch.equal(store.gather(ids), want)
        assert torch.equal(store.blocks(slice(2, 10))[:, [5, 0, 7]], want)
        rows = torch.tensor([1 * N + 2, 2 * N + 9])  # layer 1's block 2, layer 2's block 9
        assert torch.equal(store.rows(rows), torch.stack([want[1, 1], want[2, 2]]))
        assert (store.gather(torch.tensor([0, 11])) == 0).all()
        assert store.nbytes == L * N * H * (D + summary_coding.SCALE_BYTES)


def float_and_coded(**kw):
    return (BlockSummaries(L, N, H, D, BS, keep_variance=True, **kw),
            BlockSummaries(L, N, H, D, BS, keep_variance=True, coded=True, **kw))


def test_set_blocks_codes_the_float_summaries_once():
    gen = torch.Generator().manual_seed(2)
    floats, coded = float_and_coded()
    keys = torch.randn(L, 4, H, BS, D, generator=gen)
    ids = torch.tensor([3, 0, 8, 5])
    floats.set_blocks(ids, keys)
    coded.set_blocks(ids, keys)
    assert torch.equal(coded.counts, floats.counts)
    assert torch.equal(coded.sums.gather(ids), rounded(floats.sums[:, ids], "fp8"))
    torch.testing.assert_close(coded.deviations().gather(ids),
                               rounded(floats.deviations()[:, ids], "log8"))
    assert coded.nbytes() == 2 * L * N * H * (D + 4) + N * 4  # codes, scales, counts


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_a_fold_is_the_float_fold_within_a_coding_per_pass(chunk):
    """Prompts folded by passes of `chunk` tokens (1: every token its own pass, as eager
    summaries fold a decode): the counts are exact; sums and deviations are the float
    fold's within the roundings of the passes that touched each block (a block touched by
    one pass: within one coding, the same as `rounded`)."""
    lengths = [23, 8, 3]
    floats, table, _ = make_pool(lengths, block_size=BS, chunk=chunk, keep_bounds=False,
                                 keep_variance=True, seed=3)
    coded, _, _ = make_pool(lengths, block_size=BS, chunk=chunk, keep_bounds=False,
                            keep_variance=True, seed=3, coded=True)
    assert torch.equal(coded.counts, floats.counts)
    ids = table[table >= 0].unique()
    exact, got = floats.sums[:, ids], coded.sums.gather(ids)
    top = exact.abs().amax(-1, keepdim=True)
    passes = min(BS, -(-BS // chunk) + 1)  # codings of one block, at most
    assert ((got - exact).abs() <= passes * top / 14).all()
    if chunk == 64:  # each block in one pass: coded once
        assert torch.equal(got, rounded(exact, "fp8"))
    deviations = coded.deviations().gather(ids)
    want = floats.deviations()[:, ids]
    assert ((deviations - want).abs()
            <= passes * 0.05 * want + want.amax(-1, keepdim=True) * 2**-15 + 1e-6).all()


@pytest.mark.parametrize("strategy", ["gather", "all"])
@pytest.mark.parametrize("aggregation", ["sum", "softmax"])
def test_retrieval_scores_coded_summaries_as_the_rounded_float_ones(strategy, aggregation):
    """Every read of the retrieval policy (gather or the whole store, a shortlist's chunked
    reads and its copy) scores a coded store as a float store holding its rounded values:
    what `bench acceptance`'s column `retrieval_var_fp8_log` measures."""
    gen = torch.Generator().manual_seed(4)
    floats, coded = float_and_coded()
    ids = torch.arange(N)
    coded.set_blocks(ids, torch.randn(L, N, H, BS, D, generator=gen))
    floats.counts.copy_(coded.counts)
    floats.sums.copy_(coded.sums.gather(ids))
    floats.square_deviations.copy_(coded.deviations().gather(ids))
    policy = make_policy("retrieval", variance=True, strategy=strategy, aggregation=aggregation)
    query = torch.randn(2, L, 4, D, generator=gen)
    table = torch.tensor([[1, 5, 7, 0, 11], [7, 5, 1, 2, 3]])
    committed = torch.tensor([5 * BS, 5 * BS])
    torch.testing.assert_close(policy.block_scores(query, coded, table, committed),
                               policy.block_scores(query, floats, table, committed))
    listed = table[:, None, 1:].expand(2, L, 4).contiguous()
    want = policy.shortlist_scores(query, floats, listed)
    torch.testing.assert_close(policy.shortlist_scores(query, coded, listed), want)
    if aggregation == "sum":
        rows, counts = coded.layer_rows(listed), coded.counts[listed].float()
        copy = policy.listed_copy(coded, rows, counts)
        torch.testing.assert_close(policy.shortlist_scores(query, coded, listed, copy=copy),
                                   want)


def test_bench_columns_round_as_the_engine_codes():
    """`bench acceptance`'s fp8 and log8 columns round through the engine's coding."""
    from vllm_triforce.tools.bench.teacher import _rounded

    x = torch.randn(4, 6, 2, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_rounded(x, "float8_e4m3fn"), rounded(x, "fp8"))
    assert torch.equal(_rounded(x.square(), "log8"), rounded(x.square(), "log8"))


def test_coded_and_banded_variances_exclude_each_other():
    with pytest.raises(ValueError, match="coded and compact_variance"):
        BlockSummaries(L, N, H, D, BS, keep_variance=True, coded=True, compact_variance=True)
    _, coded = float_and_coded()
    with pytest.raises(ValueError, match="float per-channel"):
        coded.with_compact_variance()
