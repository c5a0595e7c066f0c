"""select_blocks / build_block_tables against a brute-force reference + invariants."""

import dataclasses
import random

import pytest
import torch

from core_toys import geometry, make_pool
from vllm_triforce.core.selection import Selection, select_blocks
from vllm_triforce.core.tables import build_block_tables


def ref_select(scores, n, bs, budget, num_sink, num_recent):
    """Plain-Python selection of one request and layer: (sorted blocks, tail_start)."""
    n_full = n // bs
    sinks = min(num_sink, n_full)
    start = max(n_full - num_recent, sinks)
    candidates = list(range(sinks, start))
    num_select = budget - num_sink - num_recent - 1
    if -(-n // bs) <= budget or len(candidates) <= num_select:
        chosen = candidates
    else:
        chosen = sorted(candidates, key=lambda b: -scores[b])[:num_select]
    return sorted(list(range(sinks)) + chosen), start


def ref_row(blocks, start, table_row, seq_len, bs):
    """Compacted physical row and its length."""
    tail = list(range(start, -(-seq_len // bs)))
    row = [int(table_row[b]) for b in blocks + tail]
    return row, len(blocks) * bs + seq_len - start * bs


def test_hand_worked_docstring_example():
    # block_size 4, 1 sink, no recent block, budget 3 -> 1 selected; 26 committed tokens
    scores = torch.zeros(1, 1, 8)
    scores[0, 0, 3] = 5.0
    sel = select_blocks(scores, torch.tensor([26]), geometry(4, budget_blocks=3, sinks=1, recent=0))
    assert sel.logical_blocks.tolist() == [[[0, 3, -1]]]
    assert sel.num_selected.tolist() == [2] and sel.tail_start.tolist() == [6]
    table = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]], dtype=torch.int32)
    tables, lens = build_block_tables(sel, table, torch.tensor([31]), 4)
    assert tables[0, 0].tolist() == [10, 13, 16, 17, 0, 0, 0, 0]
    assert lens.tolist() == [[15]]


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(seed):
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 32])
    num_sink, num_recent = rng.choice([0, 1, 2]), rng.choice([0, 1, 3])
    budget = num_sink + num_recent + 2 + rng.choice([0, 1, 3])  # the smallest, and more
    lengths = [rng.randrange(1, 40 * bs) for _ in range(5)] + [budget * bs, budget * bs + 1]
    num_layers, max_blocks = 3, max(-(-n // bs) for n in lengths) + 2
    scores = torch.randn(len(lengths), num_layers, max_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.randint(0, 1000, (len(lengths), max_blocks), dtype=torch.int32)
    sel = select_blocks(scores, torch.tensor(lengths), geometry(bs, budget, num_sink, num_recent))
    grow = [rng.choice([0, 1, bs + 1]) for _ in lengths]
    seq_lens = torch.tensor([min(n + g, max_blocks * bs) for n, g in zip(lengths, grow)])
    tables, lens = build_block_tables(sel, table, seq_lens, bs)
    for r, n in enumerate(lengths):
        for layer in range(num_layers):
            blocks, start = ref_select(scores[r, layer].tolist(), n, bs, budget, num_sink, num_recent)
            got = sel.logical_blocks[r, layer]
            assert got[got >= 0].tolist() == blocks
            assert int(sel.num_selected[r]) == len(blocks) and int(sel.tail_start[r]) == start
            row, length = ref_row(blocks, start, table[r], int(seq_lens[r]), bs)
            assert tables[layer, r, :len(row)].tolist() == row
            assert torch.all(tables[layer, r, len(row):] == 0)
            assert int(lens[layer, r]) == length


def test_invariants_mixed_batch():
    bs, budget, num_sink, num_recent, num_layers = 32, 16, 1, 2, 4
    lengths = [5, 100, budget * bs - 7, 2000, 4096, 33]  # includes prompts shorter than the budget
    max_blocks = 4096 // bs + 4
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(len(lengths), num_layers, max_blocks, generator=gen)
    num_committed = torch.tensor(lengths)
    physical = torch.stack([torch.randperm(5000, generator=gen)[:max_blocks] for _ in lengths])
    table = physical.to(torch.int32)  # [R, max_blocks] all ids distinct per row
    sel = select_blocks(scores, num_committed, geometry(bs, budget, num_sink, num_recent))
    for seq_lens in (num_committed, num_committed + 1, num_committed + 70):
        tables, lens = build_block_tables(sel, table, seq_lens, bs)
        for r, n in enumerate(lengths):
            num_blocks = -(-int(seq_lens[r]) // bs)
            logical = {int(p): j for j, p in enumerate(table[r].tolist())}
            for layer in range(num_layers):
                used = -(-int(lens[layer, r]) // bs)
                pos = [logical[int(p)] for p in tables[layer, r, :used]]
                assert pos == sorted(set(pos)), "positions strictly increasing"
                assert pos[:min(num_sink, n // bs)] == list(range(min(num_sink, n // bs))), "sinks"
                start = int(sel.tail_start[r])
                assert pos[-(num_blocks - start):] == list(range(start, num_blocks)), "tail"
                # the last slot of the row holds exactly the last block's tokens
                assert int(lens[layer, r]) - (used - 1) * bs == int(seq_lens[r]) - pos[-1] * bs
                if seq_lens is num_committed:
                    assert used <= budget, "budget at selection time"
                if -(-n // bs) <= budget:
                    assert pos == list(range(num_blocks)), "short prompt -> full table"
                    assert int(lens[layer, r]) == int(seq_lens[r])
    long_rows = tables[:, 3]
    assert not all(torch.equal(long_rows[0], long_rows[i]) for i in range(1, num_layers)), \
        "each layer selects its own blocks"


def test_nan_scores_never_displace_candidates_or_pick_non_candidates():
    scores = torch.full((1, 1, 12), float("nan"))
    sel = select_blocks(scores, torch.tensor([12 * 4]),
                        geometry(4, budget_blocks=6, sinks=1, recent=2))
    blocks = sel.logical_blocks[0, 0]
    chosen = blocks[blocks >= 0].tolist()
    assert chosen[0] == 0 and len(chosen) == 1 + 2 and all(1 <= b < 10 for b in chosen[1:])


def test_budget_too_small_is_an_error():
    """One rule, BlockCounts.min_budget_blocks: sinks + recent + the growing tail block +
    one retrieved block, whether the counts come from a user's config or a caller."""
    from vllm_triforce.config import TriForceConfig, TriForceConfigError

    with pytest.raises(ValueError, match="budget_blocks"):
        geometry(4, 4, 1, 2)
    assert geometry(4, 5, 1, 2).num_retrieved == 1
    for budget in range(1, 12):
        cfg = dict(retrieval_sink_tokens=4, retrieval_recent_tokens=5, retrieval_budget=budget * 4)
        try:  # the config's early check (blocks of one token) lets through what may fit
            config = TriForceConfig(**cfg)
        except TriForceConfigError:
            assert budget * 4 < 4 + 5 + 2
            continue
        fits = budget >= 1 + 2 + 2  # blocks of 4 tokens: 1 sink block, 2 recent blocks
        if fits:
            assert config.in_blocks(4).budget_blocks == budget
        else:
            with pytest.raises(TriForceConfigError, match="retrieval_budget"):
                config.in_blocks(4)


def test_tables_of_a_hand_written_selection():
    """Sink 0 + block 2 selected, tail from block 4, three requests, two layers."""
    sel = Selection(torch.tensor([0, 2, -1]).expand(3, 2, 3).clone(),
                    torch.tensor([2, 2, 2]), torch.tensor([4, 4, 4]))
    tables, lens = build_block_tables(sel, torch.arange(24, dtype=torch.int32).view(3, 8),
                                      torch.tensor([20, 20, 20]), 4)
    assert tables[1, 2, :3].tolist() == [16, 18, 20] and lens[0].tolist() == [12, 12, 12]


@pytest.mark.parametrize("sinks,recent,budget", [(1, 1, 4), (2, 1, 6), (0, 2, 5), (1, 3, 6)])
def test_selection_sizes_on_the_host_equal_select_blocks(sinks, recent, budget):
    """The engine sizes its passes from core.blocks.selection_sizes (Python ints) instead of
    reading the device's Selection back: the two must agree at every committed length."""
    from vllm_triforce.config import BlockCounts
    from vllm_triforce.core.blocks import selection_sizes

    bs = 4
    blocks = BlockCounts(block_size=bs, budget_blocks=budget, retrieval_sink_blocks=sinks,
                         retrieval_recent_blocks=recent)
    committed = torch.arange(0, 30 * bs + 3)
    max_blocks = 32
    scores = torch.randn(committed.numel(), 2, max_blocks,
                         generator=torch.Generator().manual_seed(0))
    sel = select_blocks(scores, committed, blocks)
    host = [selection_sizes(int(n), blocks) for n in committed]
    assert [h[0] for h in host] == sel.num_selected.tolist()
    assert [h[1] for h in host] == sel.tail_start.tolist()


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_a_shortlist_selects_what_every_candidate_would(factor, seed):
    """Between middle rounds `select_listed` ranks only the shortlist: the Selection equals
    select_blocks over scores in which every unlisted block is -inf, for every length
    (dense ones too: a request of num_retrieved + 1 candidates keeps them all, which is why
    a Selector's shortlist holds at least num_retrieved + 1, also at factor 1)."""
    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import (Selector, Shortlist, _scatter_listed,
                                              best_candidates, select_listed)

    rng = random.Random(seed)
    bs, num_sink, num_recent = 4, rng.choice([0, 1, 2]), rng.choice([0, 1, 3])
    blocks = geometry(bs, num_sink + num_recent + 1 + rng.choice([1, 3]), num_sink, num_recent)
    size = Selector(make_policy("retrieval"), blocks, shortlist_factor=factor).shortlist_size
    full = blocks.budget_blocks * bs  # fits the budget: num_retrieved + 1 candidates, all kept
    lengths = torch.tensor([full, full + 1, full + 3 * bs, 9 * full, rng.randrange(1, 9 * full)])
    gen = torch.Generator().manual_seed(seed)
    num_layers, max_blocks = 3, -(-int(lengths.max()) // bs) + 1
    at_start = torch.randn(len(lengths), num_layers, max_blocks, generator=gen)
    listed = best_candidates(at_start, lengths, blocks, size)  # [R, L, S], -1 padded
    later = torch.randn(listed.shape, generator=gen)  # the next round's scores of the list
    want = select_blocks(_scatter_listed(later, listed, max_blocks), lengths, blocks)
    table = torch.randperm(len(lengths) * max_blocks, generator=gen).view(len(lengths), -1)
    shortlist = Shortlist.of(listed, table, lengths, blocks)
    assert torch.equal(shortlist.physical, table.gather(1, listed.clamp(min=0).flatten(1))
                       .view_as(listed).masked_fill(listed < 0, -1))
    got = select_listed(later, shortlist, blocks)
    assert torch.equal(got.logical_blocks, want.logical_blocks)
    assert torch.equal(got.num_selected, want.num_selected)
    assert torch.equal(got.tail_start, want.tail_start)
    # the dense case is there: the first request keeps all num_retrieved + 1 candidates
    assert int(want.num_selected[0]) == num_sink + blocks.num_retrieved + 1


def test_a_shortlist_copy_is_made_once_reused_and_released(monkeypatch):
    """The first re-ranking of a shortlist copies its summaries (`listed_copy`); the next
    ones read only the copy (no store read), select what reading the stores selects, and
    `release_copies` frees it. One copy at a time: another shortlist's copy frees the
    first's (the selection's scratch reserves one)."""
    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import Selector

    lengths, bs = (77, 80, 61), 4
    summaries, table, _ = make_pool(lengths, block_size=bs, keep_keys=False,
                                    keep_variance=True, seed=1)
    committed = torch.tensor(lengths)
    selector = Selector(make_policy("retrieval", variance=True),
                        geometry(bs, 6, 1, 1), shortlist_factor=2)
    queries = torch.randn(4, len(lengths), 2, 4, 8, generator=torch.Generator().manual_seed(1))
    first = selector.choose(queries[0], summaries, table, committed, keep_shortlist=True)
    second = selector.choose(queries[0], summaries, table, committed, keep_shortlist=True)
    listed = first.shortlist
    reads, copies = [], []
    real_read, real_copy = type(summaries).rows_of, selector.policy.listed_copy
    monkeypatch.setattr(type(summaries), "rows_of",
                        lambda self, *a: reads.append(1) or real_read(self, *a))
    monkeypatch.setattr(selector.policy, "listed_copy",
                        lambda *a: copies.append(1) or real_copy(*a))
    picked = selector.choose(queries[1], summaries, table, committed, shortlist=listed)
    assert listed.copy is not None and reads == [] and len(copies) == 1
    again = selector.choose(queries[2], summaries, table, committed, shortlist=listed)
    assert reads == [] and len(copies) == 1  # the copy, read again
    for query, choice in ((queries[1], picked), (queries[2], again)):
        fresh = dataclasses.replace(listed, rows=None, counts=None, copy=None, copied=True)
        by_reads = selector.choose(query, summaries, table, committed, shortlist=fresh)
        assert reads  # the stores were read for it
        assert torch.equal(choice.selection.logical_blocks, by_reads.selection.logical_blocks)
    selector.choose(queries[3], summaries, table, committed, shortlist=second.shortlist)
    assert listed.copy is None and second.shortlist.copy is not None  # one at a time
    selector.release_copies()
    assert second.shortlist.copy is None and not second.shortlist.copied


@pytest.mark.parametrize("seed", range(6))
def test_tables_laid_out_on_the_host_equal_build_block_tables(seed):
    """The engine's middle tables (`TableLayout` from the host's sizes, then a few device
    operations, `laid_out_tables`) equal `build_block_tables` from the device Selection: requests of
    every kind (dense, shorter than the sinks, long), tails of one or more blocks."""
    from vllm_triforce.core.blocks import selection_sizes
    from vllm_triforce.core.tables import TableLayout, laid_out_tables

    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    budget, sinks, recent = rng.randint(4, 7), rng.choice([0, 1, 2]), rng.choice([0, 1, 2])
    blocks = geometry(bs, max(budget, sinks + recent + 2), sinks, recent)
    committed = [rng.randint(1, 40 * bs) for _ in range(rng.randint(1, 5))]
    ends = [c + rng.randint(1, 2 * bs) for c in committed]  # the pass's last token + 1
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(ends) // bs) + 1
    scores = torch.randn(len(committed), 3, max_blocks, generator=gen)
    sel = select_blocks(scores, torch.tensor(committed), blocks)
    table = torch.randperm(len(committed) * max_blocks, generator=gen).view(
        len(committed), -1).to(torch.int32)
    want, want_lens = build_block_tables(sel, table, torch.tensor(ends), bs)
    sizes = [selection_sizes(c, blocks) for c in committed]
    assert [n for n, _ in sizes] == sel.num_selected.tolist()
    layout = TableLayout.of([n for n, _ in sizes], [t for _, t in sizes], ends, bs)
    got = laid_out_tables(sel.logical_blocks, table, torch.tensor(layout.num_selected),
                          torch.tensor(layout.tail_start), torch.tensor(layout.num_tails),
                          layout.width)
    assert layout.compact_lens == want_lens[0].tolist()
    assert got.dtype == torch.int32 and got.shape[-1] == layout.width
    assert torch.equal(got, want[..., :layout.width])
    assert not want[..., layout.width:].any()  # the rest of build_block_tables' width: padding


@pytest.mark.parametrize("copied", [True, False], ids=["listed copy", "store reads"])
def test_selecting_in_chunks_of_requests_chooses_what_one_call_does(copied):
    """A Selector made with `chunk_requests` (the engine's: a chunk's score tensors are
    its scratch) selects 2 requests at a time: the Selection and the Shortlist of five
    requests are one call's, and so is a re-ranking of that shortlist (with its copy of
    the listed summaries, or reading the stores)."""
    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import Selector, selection_chunk_requests

    lengths, bs = (77, 80, 61, 90, 45), 4
    summaries, table, _ = make_pool(lengths, block_size=bs, keep_keys=False,
                                    keep_variance=True, seed=2)
    committed = torch.tensor(lengths)
    queries = torch.randn(2, len(lengths), 2, 4, 8, generator=torch.Generator().manual_seed(2))

    def selector(chunk):
        policy = make_policy("retrieval", variance=True)
        if not copied:
            policy.listed_copy = lambda *a: None
        return Selector(policy, geometry(bs, 6, 1, 1), shortlist_factor=2,
                        chunk_requests=chunk)

    whole, chunked = selector(None), selector(2)
    one = whole.choose(queries[0], summaries, table, committed, keep_shortlist=True)
    parts = chunked.choose(queries[0], summaries, table, committed, keep_shortlist=True)
    for field in ("logical_blocks", "num_selected", "tail_start"):
        assert torch.equal(getattr(one.selection, field), getattr(parts.selection, field))
    assert torch.equal(one.shortlist.logical, parts.shortlist.logical)
    assert torch.equal(one.shortlist.physical, parts.shortlist.physical)
    again = whole.choose(queries[1], summaries, table, committed, shortlist=one.shortlist)
    again_parts = chunked.choose(queries[1], summaries, table, committed,
                                 shortlist=parts.shortlist)
    assert (parts.shortlist.copy is not None) == copied
    assert torch.equal(again.selection.logical_blocks, again_parts.selection.logical_blocks)
    assert selection_chunk_requests(8192) == 32 and selection_chunk_requests(256) == 128
    assert selection_chunk_requests(10**6) == 1
