"""The hot path's tensor work on the device, without vLLM: syncs counted.

What the engine does on the device in a step and in a middle round, run here on tensors of
the device under test: the commit's fold into the block summaries (runs from the host),
selection and shortlist re-ranking, per-layer tables only as wide as needed, the middle
loop (engine/middle.py, the real one) over stand-in levels whose "models" are embedding
lookups, with mixed greedy / top-k / top-p / seeded rows, and the hand-off to vLLM.

On the CPU every tensor counts as a device tensor (vllm_triforce/tools/bench/syncs.py). On CUDA
the same tests also run under `torch.cuda.set_sync_debug_mode`: "error" where no sync may happen at
all, "warn" (each warning recorded) around the middle loop, whose rounds each end in their
one allowed device-to-host copy. tests/test_syncs.py counts the whole engine under vLLM;
this file is what a GPU machine without vLLM can run (`pytest tests/core`).
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch
from core_toys import geometry, random_block_table

from vllm_triforce.core.blocks import selection_sizes
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.selection import Selection, Selector
from vllm_triforce.core.summaries import BlockSummaries, committed_runs
from vllm_triforce.core.tables import build_block_tables
from vllm_triforce.core.verify import sample_tokens
from vllm_triforce.engine.batch import StepBatch
from vllm_triforce.engine.draft_level import draft_proposals
from vllm_triforce.engine.middle import HandOffBuffer, MiddleLoop, hand_off
from vllm_triforce.engine.device.transfer import to_device, to_host
from vllm_triforce.tools.bench.syncs import SyncCounter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 4, 2, 4, 16, 16
LENGTHS = [700, 1000, 333]  # committed tokens per request
VOCAB = 2048


@contextlib.contextmanager
def no_sync_allowed(device: str):
    """Counts syncs; on CUDA any sync also raises (set_sync_debug_mode("error"))."""
    with SyncCounter(device_type=device, strict=device == "cuda") as counter:
        yield counter


def commit_lists(lengths: list[int], new: int):
    """Host lists of one verification pass committing the last `new` tokens of each request
    (as the engine's `RetrievalLevel._add_committed_keys`): pass rows, owners, positions and
    the per-block runs."""
    positions, owners, runs, num_runs = committed_runs(
        range(len(lengths)), [n - new for n in lengths], [new] * len(lengths), BLOCK)
    return (list(range(len(positions))), owners.tolist(), positions.tolist(), runs.tolist(),
            num_runs)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_select_and_tables_make_no_sync(device):
    gen = torch.Generator().manual_seed(0)
    max_blocks = max(-(-n // BLOCK) for n in LENGTHS) + 1
    num_blocks = sum(-(-n // BLOCK) for n in LENGTHS) + 4
    table = random_block_table(LENGTHS, BLOCK, num_blocks, max_blocks, gen).to(device)
    summaries = BlockSummaries(LAYERS, num_blocks, KV_HEADS, HEAD_DIM, BLOCK, device=device,
                               keep_variance=True)
    blocks = geometry(BLOCK, budget_blocks=12, sinks=1, recent=2)
    selector = Selector(make_policy("retrieval"), blocks, shortlist_factor=2)
    new = 5  # tokens each request commits in the pass
    keys = [torch.randn(len(LENGTHS) * new, KV_HEADS * HEAD_DIM, generator=gen).to(device)
            for _ in range(LAYERS)]
    query = torch.randn(len(LENGTHS), LAYERS, Q_HEADS, HEAD_DIM, generator=gen).to(device)
    for n in range(0, max(LENGTHS) - new, 50):  # earlier tokens, outside the counted part
        short = [min(n + 50, length - new) for length in LENGTHS]
        fill(summaries, table, short, 50, gen, device)

    def step():
        rows, owners, positions, runs, num_runs = commit_lists(LENGTHS, new)
        committed = list(LENGTHS)
        ends = [n + 3 for n in committed]  # a pass of 3 query tokens past the committed ones
        rows, owners, positions, runs, committed_dev, ends_dev = to_device(
            torch.device(device), rows, owners, positions, runs, committed, ends)
        block_ids = table[owners, positions // BLOCK].long()
        summaries.add_committed(keys, rows, block_ids, positions % BLOCK, (runs, num_runs))
        choice = selector.choose(query, summaries, table, committed_dev, keep_shortlist=True)
        again = selector.choose(query, summaries, table, committed_dev,
                                shortlist=choice.shortlist)
        sizes = [selection_sizes(n, blocks) for n in committed]  # the host's, no copy
        width = max(s + -(-end // BLOCK) - t for (s, t), end in zip(sizes, ends))
        sel_dev = to_device(torch.device(device), [s for s, _ in sizes], [t for _, t in sizes])
        tables, lens = build_block_tables(
            Selection(again.selection.logical_blocks, *sel_dev), table, ends_dev, BLOCK, width)
        return choice, again, tables, lens, sizes

    step()  # warm-up: lazy initialisation (CUDA context, kernels) is not the hot path
    with no_sync_allowed(device) as counter:
        choice, again, tables, lens, sizes = step()
    assert counter.total == 0, dict(counter.by_op)
    assert choice.shortlist is not None
    num_selected, tail_start = to_host(choice.selection.num_selected,
                                       choice.selection.tail_start)
    assert list(zip(num_selected, tail_start)) == sizes  # the host's sizes are the device's
    assert tables.shape[0] == LAYERS and tables.shape[2] < table.shape[1]
    assert tables.device.type == device and lens.device.type == device


def fill(summaries, table, upto: list[int], chunk: int, gen, device) -> None:
    """Commit positions [upto - chunk, upto) of every request (random keys), un-counted."""
    rows, owners, positions = [], [], []
    for r, n in enumerate(upto):
        start = max(n - chunk, 0)
        owners += [r] * (n - start)
        positions += range(start, n)
    rows = list(range(len(positions)))
    keys = [torch.randn(len(rows), KV_HEADS * HEAD_DIM, generator=gen).to(device)
            for _ in range(LAYERS)]
    rows, owners, positions = to_device(torch.device(device), rows, owners, positions)
    summaries.add_committed(keys, rows, table[owners, positions // BLOCK].long(),
                            positions % BLOCK)


class _Lookup:
    """A stand-in level whose model maps a token to fixed logits (an embedding lookup)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # [V, V]

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits[ids]


class StandInRetrieval(_Lookup):
    """engine/retrieval_level.RetrievalStep's interface for the middle loop: one step over
    `batch` and `states`."""

    def __init__(self, logits: torch.Tensor, batch, states):
        super().__init__(logits)
        self.batch, self.states = batch, states
        self._ahead = None

    def load_ahead(self, rows, tokens, picked, positions):
        """As the engine's with round graphs: the next round's pass, its ids still on the
        device, which `forward` takes when asked for the same rows and positions."""
        if picked is not None:
            tokens = tokens[to_device(tokens.device, picked)[0]]
        self._ahead = (list(rows), positions.starts.copy(), tokens)

    def forward(self, rows, token_ids, positions):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == list(rows) and (ahead[1] == positions.starts).all():
            token_ids = ahead[2]
        if not isinstance(token_ids, torch.Tensor):  # a host list, as the engine passes it
            token_ids = to_device(self.batch.device, token_ids)[0]
        return self.run(token_ids)

    def launch_ahead(self) -> None:
        pass  # the loaded pass runs when `forward` asks for it

    def select_in_middle(self, rows, drafts_by_row):
        pass  # selection's device work: test_commit_select_and_tables_make_no_sync

    def reselect_and_load(self, *args) -> bool:
        return False  # no selection graphs: `select_in_middle`, then `load_ahead`


class StandInDraft(_Lookup):
    """engine/draft_level.DraftLevel's interface, stepping with the engine's own
    `draft_proposals` (proposals and probs stay on the device); each step's model is the
    lookup of the request's newest token, then of its previous proposal."""

    def __init__(self, logits, generator):
        super().__init__(logits)
        self.generator = generator

    def propose(self, batch, states, drafts_by_row, active, sizes, probs=True):
        def run_step(step, rows, reqs, previous):
            if previous is None:
                previous = to_device(batch.device, [drafts_by_row[r].last_token for r in reqs])[0]
            return self.run(previous)

        return draft_proposals(batch, states, active, sizes, run_step, self.generator,
                               probs=probs)

    def after_round(self, state, drafts, num_proposed, num_accepted):
        pass


class Counts:
    def __init__(self):
        self.rounds = 0

    def add(self, middle_rounds=0, **_):
        self.rounds += middle_rounds

    def record_middle(self, proposed, accepted):
        pass


def make_batch(device: str, greedy: list[bool], gen) -> StepBatch:
    num = len(greedy)
    temperature = [0.0 if g else 0.8 for g in greedy]
    top_k = [0, 50, 0, 20][:num]
    top_p = [1.0, 1.0, 0.9, 0.8][:num]
    table = random_block_table([64] * num, BLOCK, 64, 8, gen).to(device)
    seq_lens = [60 + r for r in range(num)]
    return StepBatch(
        req_ids=[str(r) for r in range(num)], seq_lens=seq_lens,
        query_start_loc=list(range(num + 1)), num_rejected=[0] * num, decoding=[True] * num,
        next_tokens=[7 * r + 1 for r in range(num)], verify_ids=[3] * num, greedy=greedy,
        block_table=table, temperature=torch.tensor(temperature, device=device),
        top_k=torch.tensor(top_k, device=device), top_p=torch.tensor(top_p, device=device),
        requests=[None] * num)


@contextlib.contextmanager
def cuda_sync_warnings(device: str):
    """On CUDA: every sync the driver sees, recorded (set_sync_debug_mode("warn"))."""
    if device != "cuda":
        yield []
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("greedy", [[True, True, True, True], [True, False, False, False]],
                         ids=["greedy", "mixed"])
@pytest.mark.parametrize("gamma1", [2, 0], ids=["three-level", "two-level"])
def test_middle_rounds_sync_once_each(device, greedy, gamma1):
    """The real MiddleLoop over stand-in levels: one sync per round (its copy of accepted
    counts and tokens), none in the hand-off; drafting happened and the middle tokens are
    the target stand-in's (every emitted token is one the retrieval level could emit).
    gamma1 0: the retrieval level drafts alone (two levels), one token per round."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(VOCAB, VOCAB, generator=gen)
    draft = target + 0.5 * torch.randn(VOCAB, VOCAB, generator=gen)  # close: some accepted
    shared = torch.Generator(device=device).manual_seed(2)
    seeded = torch.Generator(device=device).manual_seed(3)
    loop = MiddleLoop(StandInDraft(draft.to(device), shared) if gamma1 else None,
                      gamma1=gamma1, refresh=types.SimpleNamespace(record_rounds=lambda *a: None),
                      stats=Counts(), generator=shared, measure_middle_acceptance=False)
    batch = make_batch(device, greedy, gen)
    states = [types.SimpleNamespace(generator=seeded if r == 3 else None, refresh=None)
              for r in range(len(greedy))]
    step = StandInRetrieval(target.to(device), batch, states)
    rows, depths = [0, 1, 2, 3], [6, 5, 0, 6]
    buffer = HandOffBuffer(3, 6, VOCAB, device)  # a row per drafting request
    loop.run(step, rows, depths, buffer)  # warm-up
    loop.stats.rounds = 0
    with cuda_sync_warnings(device) as caught, SyncCounter(device_type=device) as counter:
        drafts_by_row = loop.run(step, rows, depths, buffer)
        counter.mark("hand-off")
        drafts, probs, prob_req_ids = hand_off(batch, drafts_by_row,
                                               depths, buffer)
    rounds = loop.stats.rounds
    assert rounds == 6 if gamma1 == 0 else rounds >= 2  # depth 6: one token or up to 3 a round
    assert counter.counts_of("step") == [rounds], dict(counter.by_op)
    assert counter.counts_of("hand-off") == [0], dict(counter.by_op)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= rounds, [str(w.message) for w in syncs]
    assert [len(d) for d in drafts] == depths
    assert (probs is None) == all(greedy) == (prob_req_ids is None)
    if probs is not None:  # the compact rows: drafting requests in order, each its own q
        assert prob_req_ids == ["0", "1", "3"] and probs.shape == (3, 6, VOCAB)
        for i, r in enumerate([0, 1, 3]):
            q_of_drafts = probs[i, torch.arange(depths[r]), torch.tensor(drafts[r])]
            assert bool((q_of_drafts > 0).all()), (r, q_of_drafts)
    if all(greedy):  # greedy middle tokens follow the target stand-in's argmax chain
        argmax = target.argmax(-1).tolist()
        for r in rows:
            chain = [batch.next_tokens[r]]
            for _ in range(depths[r]):
                chain.append(argmax[chain[-1]])
            assert drafts[r] == chain[1:]


def many_requests(device: str, num: int, gen):
    """A batch of `num` decoding requests, every fourth greedy, the others sampled with
    assorted top-k / top-p, each with a seeded generator of its own (its draws then do not
    depend on which requests share a chunk)."""
    greedy = [r % 4 == 0 for r in range(num)]
    batch = StepBatch(
        req_ids=[str(r) for r in range(num)], seq_lens=[60] * num,
        query_start_loc=list(range(num + 1)), num_rejected=[0] * num, decoding=[True] * num,
        next_tokens=[(7 * r + 1) % VOCAB for r in range(num)], verify_ids=[3] * num,
        greedy=greedy, block_table=random_block_table([64] * num, BLOCK, 64 * num, 8,
                                                      gen).to(device),
        temperature=torch.tensor([0.0 if g else 0.8 for g in greedy], device=device),
        top_k=torch.tensor([(0, 50, 0, 20)[r % 4] for r in range(num)], device=device),
        top_p=torch.tensor([(1.0, 1.0, 0.9, 0.8)[r % 4] for r in range(num)], device=device),
        requests=[None] * num)
    states = [types.SimpleNamespace(generator=torch.Generator(device=device).manual_seed(r),
                                    refresh=None) for r in range(num)]
    return batch, states


@pytest.mark.parametrize("gamma1", [2, 0], ids=["three-level", "two-level"])
def test_a_round_of_more_requests_than_a_chunk_equals_one_unchunked_round(gamma1,
                                                                          monkeypatch):
    """70 requests (two levels: more than one chunk of 64 token rows; three: four chunks of
    21 requests): the middle tokens and the hand-off rows are those of the same rounds run
    as one chunk, and a round's spare-row writes never land in a request's rows."""
    from vllm_triforce.engine import draft_level, middle

    gen = torch.Generator().manual_seed(6)
    target = torch.randn(VOCAB, VOCAB, generator=gen)
    draft = target + 0.5 * torch.randn(VOCAB, VOCAB, generator=gen)
    num, depths = 70, [(6, 5, 3, 1, 4)[r % 5] for r in range(70)]

    def run(chunked: bool):
        if not chunked:
            monkeypatch.setattr(middle, "middle_chunk_requests", lambda gamma1: 10_000)
            monkeypatch.setattr(draft_level, "MIDDLE_CHUNK_ROWS", 10_000)
        shared = torch.Generator().manual_seed(2)
        loop = MiddleLoop(StandInDraft(draft, shared) if gamma1 else None, gamma1=gamma1,
                          refresh=types.SimpleNamespace(record_rounds=lambda *a: None),
                          stats=Counts(), generator=shared, measure_middle_acceptance=False)
        batch, states = many_requests("cpu", num, torch.Generator().manual_seed(7))
        buffer = HandOffBuffer(num, 6, VOCAB)
        drafts_by_row = loop.run(StandInRetrieval(target, batch, states), list(range(num)),
                                 depths, buffer)
        drafts, probs, _ = hand_off(batch, drafts_by_row,
                                    depths, buffer)
        return drafts, probs.clone(), loop.stats.rounds

    chunked, whole = run(chunked=True), run(chunked=False)
    assert chunked[0] == whole[0] and chunked[2] == whole[2]
    assert [len(d) for d in chunked[0]] == depths
    for r, k in enumerate(depths):  # the rows vLLM reads: each request's own k
        assert torch.equal(chunked[1][r, :k], whole[1][r, :k]), r
        drafted = chunked[1][r, torch.arange(k), torch.tensor(chunked[0][r])]
        assert bool((drafted > 0).all()), r  # each draft has mass under its row


@pytest.mark.parametrize("device", DEVICES)
def test_two_level_middle_tokens_are_draws_from_the_retrieval_level(device):
    """Two levels, sampled: each middle token is a draw from the retrieval level's
    distribution after the request's temperature, top-k and top-p (what `verify` of no
    drafts would draw), the greedy row its argmax, and each kept q row is that
    distribution. Chi-square over 3,000 runs of depth 1 per sampled row."""
    from scipy.stats import chisquare

    from vllm_triforce.core.verify import sampling_probs

    vocab, runs = 6, 3000
    gen = torch.Generator().manual_seed(4)
    target = 0.7 * torch.randn(vocab, vocab, generator=gen)  # top-p keeps several tokens
    shared = torch.Generator(device=device).manual_seed(5)
    loop = MiddleLoop(None, gamma1=0,
                      refresh=types.SimpleNamespace(record_rounds=lambda *a: None),
                      stats=Counts(), generator=shared, measure_middle_acceptance=False)
    batch = make_batch(device, [True, False, False, False], gen)
    batch.next_tokens = [1, 2, 3, 4]
    states = [types.SimpleNamespace(generator=None, refresh=None)
              for _ in range(4)]
    step = StandInRetrieval(target.to(device), batch, states)
    rows = [0, 1, 2, 3]
    buffer = HandOffBuffer(4, 6, vocab, device)
    want = sampling_probs(target[batch.next_tokens].to(device), batch.temperature,
                          batch.top_k, batch.top_p, all_greedy=False).cpu()  # [4, V]
    counts = torch.zeros(4, vocab)
    for _ in range(runs):
        drafts = loop.run(step, rows, [1] * 4, buffer)
        for r in rows:
            counts[r, drafts[r].tokens[0]] += 1
    torch.testing.assert_close(buffer.rows[:, 0].cpu(), want)  # the kept q rows: p itself
    assert counts[0, int(want[0].argmax())] == runs  # greedy: the argmax every time
    for r in (1, 2, 3):
        support = want[r] > 0
        assert 2 <= int(support.sum()) < vocab or r == 1  # row 1: no top-k / top-p cut
        assert counts[r, ~support].sum() == 0, (r, counts[r], want[r])  # never outside p
        expected = want[r, support].double()
        expected = runs * expected / expected.sum()  # float32 p: renormalised for scipy
        assert chisquare(counts[r, support].double(), expected).pvalue > 1e-3, (r, counts[r])


@pytest.mark.parametrize("device", DEVICES)
def test_sample_tokens_draws_from_q_without_sync(device):
    """sample_tokens: argmax on greedy rows; drawn rows follow q (a chi-square-free check:
    a token of probability 0 is never drawn, frequencies within 4 sigma); seeded rows
    reproducible; no sync on the device."""
    q = torch.tensor([[0.0, 0.2, 0.0, 0.8], [0.5, 0.0, 0.5, 0.0], [0.1, 0.6, 0.3, 0.0]],
                     device=device).repeat(2000, 1)  # [6000, 4]
    greedy = torch.tensor([True, False, False], device=device).repeat(2000)
    shared = torch.Generator(device=device).manual_seed(0)
    gens = [None] * q.shape[0]
    sample_tokens(q[:3], greedy[:3], gens[:3], shared)  # warm-up
    with no_sync_allowed(device) as counter:
        tokens = sample_tokens(q, greedy, gens, shared)
    assert counter.total == 0, dict(counter.by_op)
    tokens = tokens.view(2000, 3).cpu()
    assert (tokens[:, 0] == 3).all()
    for row, probs in ((1, [0.5, 0.0, 0.5, 0.0]), (2, [0.1, 0.6, 0.3, 0.0])):
        freq = torch.bincount(tokens[:, row], minlength=4).double() / 2000
        for p, f in zip(probs, freq.tolist()):
            assert abs(f - p) <= 4 * (p * (1 - p) / 2000) ** 0.5 + 1e-12
    first = sample_tokens(q[:3], greedy[:3], [None, torch.Generator(device=device).manual_seed(5),
                                              None], shared)
    again = sample_tokens(q[1:2], greedy[1:2], [torch.Generator(device=device).manual_seed(5)],
                          shared)
    assert first[1].item() == again[0].item()  # a seeded row does not depend on the batch
