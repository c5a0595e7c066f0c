"""One selection path: the engine's retrieval level and the teacher-forced acceptance
benchmark choose the same blocks from the same summaries and queries, at a step's start
and between middle rounds (both call core.selection.Selector)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.refresh import RefreshPolicy
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.engine.depth import Verified
from vllm_triforce.engine.device.capture import LayerCapture
from vllm_triforce.engine.middle import RequestDrafts
from vllm_triforce.engine.retrieval_level import RetrievalLevel, RetrievalStep
from vllm_triforce.engine.state import RequestState
from vllm_triforce.engine.stats import TriForceStats
from vllm_triforce.engine.summary_keeper import SummaryKeeper
from vllm_triforce.tools.bench.teacher import Column, TeacherForcedEngine

LAYERS, KV_HEADS, Q_HEADS, DIM, BS = 3, 2, 4, 8, 4
COMMITTED = 64  # 16 full blocks: 14 candidates with 1 sink and 1 recent block
BLOCKS = BlockCounts(block_size=BS, budget_blocks=6, retrieval_sink_blocks=1,
                     retrieval_recent_blocks=1)  # 3 retrieved: a 4x shortlist is 12 of 14
NUM_REQS = 3


def logical_blocks(step, r: int) -> torch.Tensor:
    """[num_layers, max_selected] request r's selection: its row of the level's table."""
    return step.level.selections.logical[step.refresh_rows[r]].long()


def sizes(step, r: int) -> tuple[int, int]:
    """(num_selected, tail_start) of request r's selection, as the host holds them."""
    table, slot = step.level.selections, step.refresh_rows[r]
    return int(table.num_selected[slot]), int(table.tail_start[slot])


def shortlist(step, r: int) -> torch.Tensor:
    """[num_layers, S] request r's shortlist, logical blocks: its row of the step's."""
    return step._shortlist.logical[step.level.selections.shortlist_row[step.refresh_rows[r]]]


def summarised_requests(seed: int):
    """Summaries of NUM_REQS requests of COMMITTED random keys on shuffled physical blocks
    (every kind of state, the key copy included), and their block table [R, 17]."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = NUM_REQS * 17 + 1
    table = torch.randperm(num_blocks, generator=gen)[:NUM_REQS * 17].view(NUM_REQS, 17)
    summaries = BlockSummaries(LAYERS, num_blocks, KV_HEADS, DIM, BS, keep_keys=True,
                               keep_bounds=True, keep_variance=True)
    positions = torch.arange(COMMITTED)
    for r in range(NUM_REQS):
        keys = [torch.randn(COMMITTED, KV_HEADS * DIM, generator=gen) for _ in range(LAYERS)]
        summaries.add_committed(keys, positions, table[r, positions // BS], positions % BS)
    return summaries, table.to(torch.int32), gen


def engine_level(summaries, selector, queries):
    """A RetrievalLevel whose capture holds `queries` [R, L, Hq, D] as the last committed
    tokens' (one token per request in the verification pass)."""
    capture = LayerCapture(LAYERS)
    capture.queries = [queries[:, layer].reshape(NUM_REQS, -1) for layer in range(LAYERS)]
    stats, device = TriForceStats(), torch.device("cpu")
    keeper = SummaryKeeper(summaries, capture, selector, stats, device)
    return RetrievalLevel(None, None, None, [f"layer{i}" for i in range(LAYERS)], Q_HEADS, DIM,
                          capture, keeper, selector, RefreshPolicy(1, 0.5), stats, device)


def decode_step(level, table):
    """A decode step (one token per request, COMMITTED committed) of fresh requests: the
    step `RetrievalLevel.begin_step` makes after its commit, which judged no drafts."""
    batch = SimpleNamespace(block_table=table, num_reqs=NUM_REQS,
                            committed=[COMMITTED] * NUM_REQS,
                            committed_array=np.full(NUM_REQS, COMMITTED, dtype=np.int64),
                            q_lens=[1] * NUM_REQS, num_rejected=[0] * NUM_REQS,
                            query_start_loc=list(range(NUM_REQS + 1)),
                            last_committed_rows=np.arange(NUM_REQS))  # its one token's row
    states = [RequestState(refresh=level.refresh.new_state(), policy_state=SelectionState())
              for _ in range(NUM_REQS)]
    return RetrievalStep(level, batch, states, verified=Verified.none(), prefills=[],
                         refresh_rows=np.array([st.refresh for st in states]))


@pytest.mark.parametrize("policy,kwargs", [("retrieval", {"variance": True}),
                                           ("retrieval", {"variance": False}),
                                           ("rerank", {}), ("quest", {})])
def test_engine_and_teacher_choose_the_same_blocks(policy, kwargs):
    summaries, table, gen = summarised_requests(seed=len(policy))
    start_query = torch.randn(NUM_REQS, LAYERS, Q_HEADS, DIM, generator=gen)
    middle_query = torch.randn(NUM_REQS, LAYERS, Q_HEADS, DIM, generator=gen)

    # the engine: a step start, then a middle round's re-selection
    selector = Selector(make_policy(policy, **kwargs), BLOCKS, shortlist_factor=4, keys=summaries)
    step = decode_step(engine_level(summaries, selector, start_query), table)
    rows = list(range(NUM_REQS))
    step.select(rows)
    at_start = [(logical_blocks(step, r).clone(), *sizes(step, r)) for r in rows]
    step._pass_queries = [middle_query[:, layer].reshape(NUM_REQS, -1)
                          for layer in range(LAYERS)]  # as a middle round's `forward` keeps
    drafts = {r: RequestDrafts(0, COMMITTED + 1) for r in rows}
    for r in rows:
        drafts[r].query_row = r
    step.select_in_middle(rows, drafts)
    in_middle = [(logical_blocks(step, r), *sizes(step, r)) for r in rows]

    # the teacher: the same two selections through a column
    column = Column("c", Selector(make_policy(policy, **kwargs), BLOCKS, 4, keys=summaries),
                    refresh_every=6, middle_queries=True)
    teacher = SimpleNamespace(summaries=summaries)
    first = TeacherForcedEngine.select(teacher, column, start_query, table, COMMITTED)
    then = TeacherForcedEngine.select(teacher, column, middle_query, table, COMMITTED,
                                      middle=True)

    for selection, engine_side in ((first, at_start), (then, in_middle)):
        for r, (logical, num_selected, tail) in enumerate(engine_side):
            assert torch.equal(selection.logical_blocks[r], logical)
            assert (int(selection.num_selected[r]), int(selection.tail_start[r])) == (
                num_selected, tail)
    # the middle re-selection saw a new query: for the retrieval policies it re-ranked the
    # step start's shortlist (12 of the 14 candidates), and the choice moved
    reranks = selector.shortlist_size > 0
    assert reranks == (policy == "retrieval")
    if reranks:
        assert column.listed is not None and column.listed.logical.shape == (
            NUM_REQS, LAYERS, 12)
        assert torch.equal(torch.stack([shortlist(step, r) for r in rows]),
                           column.listed.logical)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(at_start, in_middle))


def test_middle_rounds_of_fewer_requests_reuse_their_shortlist_copy(monkeypatch):
    """Requests drop out of the middle rounds as they reach their depth: the rounds of the
    ones left re-rank the same subset of the step's shortlist (the step keeps the last
    subset it made and takes it again, so its copy of the summaries is made once), and
    choose what re-ranking the whole shortlist chooses for them."""
    summaries, table, gen = summarised_requests(seed=5)
    start_query = torch.randn(NUM_REQS, LAYERS, Q_HEADS, DIM, generator=gen)
    selector = Selector(make_policy("retrieval", variance=True), BLOCKS, shortlist_factor=4)
    copies = []
    real_copy = selector.policy.listed_copy
    monkeypatch.setattr(selector.policy, "listed_copy",
                        lambda *a: copies.append(a[1].shape[0]) or real_copy(*a))
    step = decode_step(engine_level(summaries, selector, start_query), table)
    rows, left = list(range(NUM_REQS)), [0, 2]
    step.select(rows)
    drafts = {r: RequestDrafts(0, COMMITTED + 1) for r in rows}
    subsets = []
    for round_ in range(3):
        query = torch.randn(NUM_REQS, LAYERS, Q_HEADS, DIM, generator=gen)
        step._pass_queries = [query[:, layer].reshape(NUM_REQS, -1) for layer in range(LAYERS)]
        for r in rows:
            drafts[r].query_row, drafts[r].position = r, COMMITTED + 1 + 2 * round_
        step.select_in_middle(rows, drafts)  # every request
        everyone = [logical_blocks(step, r).clone() for r in left]
        for r in left:  # a re-selection is due again: the next middle token's query
            drafts[r].position += 1
        step.select_in_middle(left, drafts)  # requests 0 and 2 only
        assert all(torch.equal(logical_blocks(step, r), e) for r, e in zip(left, everyone))
        subsets.append(step._last_subset[1])
    assert all(s is subsets[0] for s in subsets)
    # per round: the whole list's copy, then the subset's (one copy at a time); the subset
    # object is the same every round, yet each of its copies was freed by the whole one's
    assert copies == [NUM_REQS, 2] * 3
    step.close()
    assert step._shortlist.copy is None and subsets[0].copy is None
