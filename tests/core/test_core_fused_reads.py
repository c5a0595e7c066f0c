"""The compiled block scoring (core/fused_reads.py, `compiled_selection`): a step's
selection's scores as the eager reads of coded summaries give them, its selection and
shortlist from one graph as the eager ones, and a shortlist's
re-ranking, query to selection, as the chunked reads then `select_listed` make it, from
one compilation for every batch, table and shortlist size, with no copy of the listed
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
BLOCKS = BlockCounts(block_size=BS, budget_blocks=6, retrieval_sink_blocks=1,
                     retrieval_recent_blocks=1)


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


def shortlisted(selector, summaries, requests: int, width: int, gen):
    """A step's choice with its shortlist (eagerly, as the engine's step start makes it)
    for `requests` random tables of `width` blocks, and (table, committed, a later query)
    to re-rank it with."""
    table = torch.randperm(N, generator=gen)[:requests * width].view(requests, width)
    committed = width * BS - torch.randint(0, BS, (requests,), generator=gen)
    query = torch.randn(requests, L, 4, D, generator=gen)
    compiled, selector.policy.compiled = selector.policy.compiled, None
    shortlist = selector.choose(query, summaries, table, committed,
                                keep_shortlist=True).shortlist
    selector.policy.compiled = compiled
    return shortlist, table, committed, torch.randn(requests, L, 4, D, generator=gen)


@pytest.mark.parametrize("variance", [False, True])
def test_compiled_reranking_selects_as_the_chunked_reads(monkeypatch, variance):
    """A shortlist re-ranked by the compiled graph (query to selection) picks the blocks
    the chunked reads then `select_listed` pick, for batches of every size, 1 included,
    and lists shorter than a selection keeps (a table of few blocks: padded), compiling
    once; with it the Selector makes no copy of the listed summaries. Random summaries:
    no near-ties at this size."""
    summaries = coded_summaries(5)
    blocks = BLOCKS
    policy = make_policy("retrieval", variance=variance)
    selector = Selector(policy, blocks, shortlist_factor=3)
    compiled = CompiledScores(summaries, variance, blocks, num_q_heads=4)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 4 * 2 * H * D * 3)  # 3 rows a chunk
    gen = torch.Generator().manual_seed(2)
    short = 0
    for requests, width in [(1, 18), (3, 10), (2, 3), (5, 8), (1, 2)]:
        shortlist, table, committed, query = shortlisted(selector, summaries, requests,
                                                         width, gen)
        short += shortlist.logical.shape[-1] < blocks.max_chosen
        policy.compiled = None
        want = selector.choose(query, summaries, table, committed, shortlist=shortlist)
        selector.release_copies()
        policy.compiled = compiled
        got = selector.choose(query, summaries, table, committed, shortlist=shortlist)
        assert policy.compiled is compiled and shortlist.copy is None
        for field in ("logical_blocks", "num_selected", "tail_start"):
            assert torch.equal(getattr(got.selection, field), getattr(want.selection, field))
    assert short  # a list shorter than max_chosen was among them
    assert counters["stats"]["unique_graphs"] == graphs  # no size compiled anew


@pytest.mark.parametrize("variance", [False, True])
def test_a_steps_selection_and_shortlist_are_one_graph_of_the_eager_ones(variance):
    """A step's selection with its shortlist (`keep_shortlist`), made by one compiled graph
    from the query (`CompiledScores.choose_table`), is the one the eager reads then
    `select_blocks`, `best_candidates` and `Shortlist.of` make: blocks, sizes, the
    shortlist's blocks, summary rows, counts and frame, for batches of every size, 1
    included, and tables narrower than a shortlist (padded, then cut back), compiling
    once; without `keep_shortlist`, no shortlist. Random summaries: no near-ties."""
    summaries = coded_summaries(11)
    policy = make_policy("retrieval", variance=variance)
    selector = Selector(policy, BLOCKS, shortlist_factor=3)
    compiled = CompiledScores(summaries, variance, BLOCKS, num_q_heads=4,
                              shortlist_size=selector.shortlist_size)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(12)
    narrow = 0
    for requests, width in [(1, 18), (3, 10), (2, 3), (5, 8), (1, 2), (3, 13)]:
        narrow += width < selector.shortlist_size
        table = torch.randperm(N, generator=gen)[:requests * width].view(requests, width)
        committed = width * BS - torch.randint(0, BS, (requests,), generator=gen)
        query = torch.randn(requests, L, 4, D, generator=gen)
        for keep in (False, True):
            policy.compiled = None
            want = selector.choose(query, summaries, table, committed, keep_shortlist=keep)
            policy.compiled = compiled
            got = selector.choose(query, summaries, table, committed, keep_shortlist=keep)
            assert policy.compiled is compiled, "the graph fell back to the eager reads"
            for field in ("logical_blocks", "num_selected", "tail_start"):
                assert torch.equal(getattr(got.selection, field), getattr(want.selection, field))
            if not keep:
                assert got.shortlist is None
                continue
            want.shortlist.summary_rows(summaries)
            for field in ("logical", "physical", "rows", "counts"):
                assert torch.equal(getattr(got.shortlist, field),
                                   getattr(want.shortlist, field)), (field, requests, width)
            for field in ("num_chosen", "sink_ids", "num_selected", "tail_start"):
                assert torch.equal(getattr(got.shortlist.frame, field),
                                   getattr(want.shortlist.frame, field))
    assert narrow  # a table narrower than the shortlist was among them
    assert counters["stats"]["unique_graphs"] == graphs  # no size compiled anew


def test_a_steps_selection_that_does_not_compile_ranks_the_compiled_scores(monkeypatch):
    """Where the step's whole selection fails to compile at the warm-up, the warm-up says
    why (`table_failed`) and the rest stays compiled: the step's block scores are the
    compiled kernel's, ranked eagerly, and the selection is the eager one."""
    from vllm_triforce.core import fused_reads

    def refused(*args, **kwargs):
        raise NotImplementedError("refused")

    monkeypatch.setattr(fused_reads, "rank_table", refused)
    summaries = coded_summaries(13)
    selector = Selector(make_policy("retrieval", variance=True), BLOCKS, shortlist_factor=3)
    compiled = CompiledScores(summaries, True, BLOCKS, num_q_heads=4,
                              shortlist_size=selector.shortlist_size)
    compiled.warm_up()
    assert compiled.table_failed is not None  # dynamo says it observed an exception
    gen = torch.Generator().manual_seed(14)
    table = torch.randperm(N, generator=gen)[:24].view(2, 12)
    committed, query = torch.tensor([48, 45]), torch.randn(2, L, 4, D, generator=gen)
    want = selector.choose(query, summaries, table, committed, keep_shortlist=True)
    calls, tables = [], compiled.tables
    monkeypatch.setattr(compiled, "tables", lambda *a, **k: calls.append(1) or tables(*a, **k))
    selector.policy.compiled = compiled
    got = selector.choose(query, summaries, table, committed, keep_shortlist=True)
    assert calls and selector.policy.compiled is compiled  # scored by the kernel, kept
    assert torch.equal(got.selection.logical_blocks, want.selection.logical_blocks)
    assert torch.equal(got.shortlist.logical, want.shortlist.logical)


def test_the_kernels_hold_when_everything_runs_in_inference_mode():
    """As vLLM runs the engine: summaries, warm-up and calls in inference mode, where no
    argument is copied, so two that alias at the warm-up would be guarded to alias ever
    after; the kernels serve the calls and re-rank as the eager reads do."""
    with torch.inference_mode():
        summaries = coded_summaries(6)
        selector = Selector(make_policy("retrieval", variance=True), BLOCKS, shortlist_factor=3)
        compiled = CompiledScores(summaries, True, BLOCKS, num_q_heads=4)
        compiled.warm_up()
        for requests, width in [(2, 12), (1, 7)]:
            shortlist, table, committed, query = shortlisted(
                selector, summaries, requests, width, torch.Generator().manual_seed(width))
            want = selector.choose(query, summaries, table, committed, shortlist=shortlist)
            selector.release_copies()
            selector.policy.compiled = compiled
            got = selector.choose(query, summaries, table, committed, shortlist=shortlist)
            assert selector.policy.compiled is compiled, "the kernel fell back"
            assert torch.equal(got.selection.logical_blocks, want.selection.logical_blocks)
            selector.policy.compiled = None


def test_the_compiled_reranking_is_its_eager_arithmetic():
    """Compiled, `listed_choice` returns what the same function returns eagerly."""
    summaries = coded_summaries(3)
    blocks = BlockCounts(block_size=BS, budget_blocks=8, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    selector = Selector(make_policy("retrieval", variance=True), blocks, shortlist_factor=2)
    compiled = CompiledScores(summaries, True, blocks, num_q_heads=4)
    compiled.warm_up()
    shortlist, _, _, query = shortlisted(selector, summaries, 3, 12,
                                         torch.Generator().manual_seed(4))
    shortlist.summary_rows(summaries)
    shortlist.padding = shortlist.logical < 0
    got = compiled.choose_listed(query, shortlist)
    compiled._listed._compiled = compiled._listed.eager  # the same call, not compiled
    assert torch.equal(got, compiled.choose_listed(query, shortlist))


@pytest.mark.parametrize("strategy", ["gather", "all"])
def test_compiled_selection_scores_a_steps_tables_as_the_eager_reads(strategy):
    """A step's selection scores every block of each request's table (padding -1 reads
    block 0, as the eager reads do): the compiled kernel gives the eager strategy's scores
    for tables of any width, without compiling again."""
    summaries = coded_summaries(7)
    policy = make_policy("retrieval", variance=True, strategy=strategy)
    compiled = CompiledScores(summaries, True, BLOCKS, num_q_heads=4)
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


def test_compiled_selection_reads_only_its_own_summaries():
    """A policy whose kernels were built over other summaries scores and re-ranks these
    eagerly."""
    summaries, other = coded_summaries(0), coded_summaries(1)
    selector = Selector(make_policy("retrieval", variance=True), BLOCKS, shortlist_factor=3)
    selector.policy.compiled = CompiledScores(other, True, BLOCKS, num_q_heads=4)
    shortlist, _, _, query = shortlisted(selector, summaries, 2, 12,
                                         torch.Generator().manual_seed(3))
    assert selector.policy.listed_selection(query, summaries, shortlist) is None
    table = torch.randint(0, N, (2, 9), generator=torch.Generator().manual_seed(4))
    scores = selector.policy.block_scores(query, summaries, table, torch.tensor([36, 30]))
    selector.policy.compiled = None
    assert torch.equal(scores, selector.policy.block_scores(query, summaries, table,
                                                            torch.tensor([36, 30])))


def test_a_call_that_would_compile_again_fails_and_the_policy_reads_eagerly(caplog):
    """After the warm-up nothing compiles again: a call whose guards fail (ids as int32)
    raises rather than run the eager arithmetic, which would hold every decoded row; the
    policy drops the kernels, says so, and scores and re-ranks eagerly from then on."""
    summaries = coded_summaries(9)
    compiled = CompiledScores(summaries, True, BLOCKS, num_q_heads=4)
    compiled.warm_up()
    ids, counts = torch.randint(0, N, (2, 5)), torch.ones(2, 5)
    weights = [torch.randn(2, L, H, D), torch.rand(2, L, H, D)]
    compiled.tables(ids, counts, weights)
    with pytest.raises(RuntimeError, match="recompile"):
        compiled.tables(ids.int(), counts, weights)
    selector = Selector(make_policy("retrieval", variance=True), BLOCKS, shortlist_factor=3)
    shortlist, table, committed, query = shortlisted(selector, summaries, 2, 12,
                                                     torch.Generator().manual_seed(10))
    want = selector.choose(query, summaries, table, committed, shortlist=shortlist)
    selector.release_copies()
    selector.policy.compiled = compiled
    compiled._stores = [(c.double(), s, t) for c, s, t in compiled._stores]  # guards now fail
    with caplog.at_level("WARNING"):
        got = selector.choose(query, summaries, table, committed, shortlist=shortlist)
    assert selector.policy.compiled is None and "read the summaries eagerly" in caplog.text
    assert torch.equal(got.selection.logical_blocks, want.selection.logical_blocks)


def test_compiled_scores_refuse_float_summaries():
    floats = BlockSummaries(L, N, H, D, BS, keep_variance=True)
    with pytest.raises(ValueError, match="coded summaries"):
        CompiledScores(floats, True, BLOCKS, num_q_heads=4)
