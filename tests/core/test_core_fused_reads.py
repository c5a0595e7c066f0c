"""The compiled block scoring (core/fused_reads.py, `compiled_scoring`): the scores the
chunked reads of coded summaries give, a step's selection's and a shortlist's re-ranking,
from one compilation for every batch, table and shortlist size, with no copy of the listed
summaries."""

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_triforce.core import reads
from vllm_triforce.core.fused_reads import CompiledScores, listed_dots
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.summary_coding import CODINGS, decode, decode_table, encode
from vllm_triforce.config import BlockCounts

L, N, H, D, BS = 3, 40, 2, 16, 4


def coded_summaries(seed: int = 0) -> BlockSummaries:
    gen = torch.Generator().manual_seed(seed)
    summaries = BlockSummaries(L, N, H, D, BS, keep_variance=True, coded=True)
    summaries.set_blocks(torch.arange(N), torch.randn(L, N, H, BS, D, generator=gen))
    return summaries


@pytest.mark.parametrize("coding", CODINGS)
def test_the_decode_table_reads_every_code_as_decode_does(coding):
    """table[codes] x scales is `decode`, value for value, for every code a store holds."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-4, 4, 32)[:, None]
    codes, scales = encode(x if coding == "fp8" else x.square(), coding)
    assert torch.equal(decode_table(coding)[codes.long()] * scales,
                       decode(codes, scales, coding))
    every = torch.arange(256, dtype=torch.uint8)[None]
    if coding == "log8":  # fp8's two NaN codes are never written; the table reads them 0
        assert torch.equal(decode_table(coding), decode(every, torch.ones(1, 1), coding)[0])


def test_listed_dots_worked_example():
    """The module docstring's example, by hand: one layer, one KV head, two channels."""
    codes, scales = encode(torch.tensor([[[1.0, -2.0]], [[0.5, 0.5]], [[4.0, 0.0]],
                                         [[0.0, 3.0]]]), "fp8")
    rows = torch.tensor([[[0, 1, 3]], [[2, 2, 0]]])
    weights = torch.tensor([[[[1.0, 1.0]]], [[[2.0, -1.0]]]])
    counts = torch.tensor([[[1.0, 2.0, 1.0]], [[4.0, 1.0, 1.0]]])
    got = listed_dots(rows, counts, weights, codes, scales, decode_table("fp8"))
    torch.testing.assert_close(got, torch.tensor([[[-1.0, 0.5, 3.0]], [[2.0, 8.0, 4.0]]]))


@pytest.mark.parametrize("variance", [False, True])
def test_compiled_scoring_scores_as_the_chunked_reads(monkeypatch, variance):
    """The compiled kernel gives the chunked reads' scores (to float32 rounding) for
    batches and shortlists of every size, 1 included, padding included, compiling once;
    with it the policy makes no copy of the listed summaries."""
    summaries = coded_summaries()
    policy = make_policy("retrieval", variance=variance)
    compiled = CompiledScores(summaries, variance)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 4 * 2 * H * D * 3)  # 3 rows a chunk
    gen = torch.Generator().manual_seed(2)
    for requests, size in [(1, 1), (3, 7), (2, 1), (5, 13)]:
        blocks = torch.randint(0, N, (requests, L, size), generator=gen)
        blocks[0, 0, -1] = -1  # padding reads block 0, as the eager reads do
        query = torch.randn(requests, L, 4, D, generator=gen)
        rows = summaries.layer_rows(blocks)
        counts = summaries.counts[blocks.clamp(min=0)].clamp(min=1).float()
        policy.compiled = None
        want = policy.shortlist_scores(query, summaries, blocks, rows=rows, counts=counts)
        policy.compiled = compiled
        got = policy.shortlist_scores(query, summaries, blocks, rows=rows, counts=counts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert policy.listed_copy(summaries, rows, counts) is None
    assert counters["stats"]["unique_graphs"] == graphs  # no size compiled anew


@pytest.mark.parametrize("strategy", ["gather", "all"])
def test_compiled_scoring_scores_a_steps_tables_as_the_eager_reads(strategy):
    """A step's selection scores every block of each request's table (padding -1 reads
    block 0, as the eager reads do): the compiled kernel gives the eager strategy's scores
    for tables of any width, without compiling again."""
    summaries = coded_summaries(7)
    policy = make_policy("retrieval", variance=True, strategy=strategy)
    compiled = CompiledScores(summaries, True)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(8)
    for requests, width in [(1, 1), (2, 9), (4, 30)]:
        table = torch.randint(0, N, (requests, width), generator=gen)
        table[-1, -1] = -1
        committed = torch.full((requests,), width * BS)
        query = torch.randn(requests, L, 4, D, generator=gen)
        policy.compiled = None
        want = policy.block_scores(query, summaries, table, committed)
        policy.compiled = compiled
        got = policy.block_scores(query, summaries, table, committed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_scoring_reads_only_its_own_summaries():
    """A policy whose kernel was built over other summaries reads these eagerly."""
    summaries, other = coded_summaries(0), coded_summaries(1)
    policy = make_policy("retrieval", variance=True)
    policy.compiled = CompiledScores(other, True)
    blocks = torch.randint(0, N, (2, L, 5), generator=torch.Generator().manual_seed(3))
    query = torch.randn(2, L, 4, D, generator=torch.Generator().manual_seed(4))
    compiled = policy.shortlist_scores(query, summaries, blocks)
    policy.compiled = None
    assert torch.equal(compiled, policy.shortlist_scores(query, summaries, blocks))


def test_compiled_scoring_selects_as_the_chunked_reads():
    """Through `Selector.choose`: a shortlist re-ranked by the kernel picks the blocks the
    eager reads pick (random summaries: no near-ties at this size)."""
    summaries = coded_summaries(5)
    blocks = BlockCounts(block_size=BS, budget_blocks=6, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    policy = make_policy("retrieval", variance=True)
    selector = Selector(policy, blocks, shortlist_factor=3)
    gen = torch.Generator().manual_seed(6)
    table = torch.randperm(N, generator=gen)[:36].view(2, 18)
    committed = torch.tensor([18 * BS, 15 * BS + 2])
    query = torch.randn(2, L, 4, D, generator=gen)
    shortlist = selector.choose(query, summaries, table, committed,
                                keep_shortlist=True).shortlist
    again = torch.randn(2, L, 4, D, generator=gen)
    eager = selector.choose(again, summaries, table, committed, shortlist=shortlist)
    selector.release_copies()
    policy.compiled = CompiledScores(summaries, True)
    compiled = selector.choose(again, summaries, table, committed, shortlist=shortlist)
    assert shortlist.copy is None
    assert torch.equal(compiled.selection.logical_blocks, eager.selection.logical_blocks)


def test_a_call_that_would_compile_again_fails_and_the_policy_reads_eagerly(caplog):
    """After the warm-up nothing compiles again: a call whose guards fail (rows as int32)
    raises rather than run the eager arithmetic, which would hold every decoded row; the
    policy drops the kernel, says so, and scores by the eager reads from then on."""
    summaries = coded_summaries(9)
    compiled = CompiledScores(summaries, True)
    compiled.warm_up()
    rows = summaries.layer_rows(torch.randint(0, N, (2, L, 5)))
    counts = torch.ones(2, L, 5)
    weights = [torch.randn(2, L, H, D), torch.rand(2, L, H, D)]
    compiled.listed(rows, counts, weights)
    with pytest.raises(RuntimeError, match="recompile"):
        compiled.listed(rows.int(), counts, weights)
    policy = make_policy("retrieval", variance=True)
    blocks = torch.randint(0, N, (2, L, 5), generator=torch.Generator().manual_seed(10))
    query = torch.randn(2, L, 4, D, generator=torch.Generator().manual_seed(11))
    want = policy.shortlist_scores(query, summaries, blocks)
    policy.compiled = compiled
    compiled._stores = [(c.double(), s, t) for c, s, t in compiled._stores]  # guards now fail
    with caplog.at_level("WARNING"):
        got = policy.shortlist_scores(query, summaries, blocks)
    assert policy.compiled is None and "read the summaries eagerly" in caplog.text
    assert torch.equal(got, want)


def test_listed_scores_refuses_float_summaries():
    floats = BlockSummaries(L, N, H, D, BS, keep_variance=True)
    with pytest.raises(ValueError, match="coded summaries"):
        CompiledScores(floats, True)
