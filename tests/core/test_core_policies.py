"""Every selection policy against a brute-force reference written here."""

import math

import pytest
import torch

from core_toys import geometry, make_pool
from vllm_triforce.core.policies import POLICIES, make_policy
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import select_blocks

BS = 4


def rescore_shortlist(policy, query, summaries, block_table, listed):
    """Reference: scores for select_blocks [R, L, max_blocks] in which only the blocks of
    `listed` ([R, L, S] logical, from `best_candidates`) are scored, by
    `policy.shortlist_scores` with `query`; every other block gets -inf, so it is chosen
    only when the list runs out (the engine re-ranks with `select_listed` instead, no
    full-width scores)."""
    from vllm_triforce.core.selection import _physical, _scatter_listed

    phys = _physical(block_table, listed)
    return _scatter_listed(policy.shortlist_scores(query, summaries, phys), listed,
                           block_table.shape[1])


def ref_retrieval(query, keys, n, aggregation):
    """query [L, Hq, D], keys [L, n, Hkv, D] of one request -> [L, n_full] by loops."""
    num_layers, num_q, dim = query.shape
    group = num_q // keys.shape[2]
    n_full = n // BS
    per_head = torch.zeros(num_layers, num_q, n_full)
    for layer in range(num_layers):
        for h in range(num_q):
            per_head[layer, h] = torch.tensor([
                float(query[layer, h] @ keys[layer, b * BS:(b + 1) * BS, h // group].mean(0))
                / math.sqrt(dim) for b in range(n_full)])
    return ref_aggregate(per_head, aggregation)


def ref_aggregate(per_head, aggregation):
    """[L, Hq, n_full] -> [L, n_full]."""
    if aggregation == "max":
        return per_head.amax(1)
    if aggregation == "softmax":
        return per_head.softmax(-1).sum(1)
    return per_head.sum(1)


def ref_per_block(query, keys, n, aggregation, score):
    """score(q [D] / sqrt(D), block keys [BS, D], layer, KV head) per query head and full
    block, by loops, then aggregated -> [L, n_full]."""
    num_layers, num_q, dim = query.shape
    group = num_q // keys.shape[2]
    per_head = torch.zeros(num_layers, num_q, n // BS)
    for layer in range(num_layers):
        for h in range(num_q):
            for b in range(n // BS):
                block = keys[layer, b * BS:(b + 1) * BS, h // group]  # [BS, D]
                per_head[layer, h, b] = score(query[layer, h] / math.sqrt(dim), block, layer,
                                              h // group)
    return ref_aggregate(per_head, aggregation)


def ref_quest(query, keys, n, aggregation):
    """Quest bound: per head, sum over channels of the larger of q_d * min_d and
    q_d * max_d over the block's keys -> [L, n_full]."""
    def bound(q, block, *_):
        lo, hi = block.amin(0), block.amax(0)
        return sum(max(float(q[d] * lo[d]), float(q[d] * hi[d])) for d in range(len(q)))
    return ref_per_block(query, keys, n, aggregation, bound)


def ref_mass(query, keys, n):
    """Exact attention mass per block, summed over query heads: [L, ceil(n / BS)]."""
    num_layers, num_q, dim = query.shape
    group = num_q // keys.shape[2]
    out = torch.zeros(num_layers, -(-n // BS))
    for layer in range(num_layers):
        for h in range(num_q):
            logits = torch.stack([query[layer, h] @ keys[layer, t, h // group] for t in range(n)])
            probs = (logits / math.sqrt(dim)).softmax(0)
            for t in range(n):
                out[layer, t // BS] += probs[t]
    return out


def setup(num_q, num_kv, lengths=(37, 9, 24), seed=0, squares=False, compact=False):
    summaries, table, keys = make_pool(list(lengths), num_layers=2, num_kv_heads=num_kv,
                                       head_dim=8, block_size=BS, seed=seed,
                                       keep_variance=squares, compact_variance=compact)
    query = torch.randn(len(lengths), 2, num_q, 8, generator=torch.Generator().manual_seed(seed + 1))
    return summaries, table, keys, query, torch.tensor(lengths)


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (12, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
@pytest.mark.parametrize("strategy", ["gather", "all"])
def test_retrieval_matches_reference(num_q, num_kv, aggregation, strategy):
    summaries, table, keys, query, lengths = setup(num_q, num_kv)
    policy = make_policy("retrieval", aggregation=aggregation, strategy=strategy)
    scores = policy.block_scores(query, summaries, table, lengths, None)
    assert scores.shape == (3, 2, table.shape[1])
    for r, n in enumerate(lengths.tolist()):
        ref = ref_retrieval(query[r], keys[r], n, aggregation)
        torch.testing.assert_close(scores[r, :, :n // BS], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (12, 2), (9, 3)])
def test_gqa_query_head_reads_its_own_kv_head(num_q, num_kv):
    """Only query head h is non-zero: the block whose KV head h // group matches it wins."""
    group = num_q // num_kv
    summaries, table, _, _, lengths = setup(num_q, num_kv, lengths=(4 * BS * num_kv,))
    summaries.sums.zero_()
    direction = torch.zeros(8)
    direction[0] = 1.0
    for kv in range(num_kv):  # block 2 * kv + 1 matches KV head kv only
        summaries.sums[:, int(table[0, 2 * kv + 1]), kv] = 10.0 * BS * direction
    policy = make_policy("retrieval")
    for h in range(num_q):
        query = torch.zeros(1, 2, num_q, 8)
        query[0, :, h] = direction
        scores = policy.block_scores(query, summaries, table, lengths, None)
        assert int(scores[0, 0].argmax()) == 2 * (h // group) + 1, f"q head {h}"


def test_streamingllm_keeps_sinks_and_recent_window():
    summaries, table, _, query, lengths = setup(4, 2, lengths=(80, 13))
    scores = make_policy("streamingllm").block_scores(query, summaries, table, lengths, None)
    sel = select_blocks(scores, lengths, geometry(BS, budget_blocks=8, sinks=2, recent=2))
    # 80 tokens: 20 full blocks, tail from 18, 3 chosen -> the 3 blocks right before the tail
    assert sel.logical_blocks[0, 0].tolist() == [0, 1, 15, 16, 17, -1]
    assert sel.tail_start.tolist() == [18, 2]  # 13 tokens: 3 full blocks, 2 sinks
    # 13 tokens: 4 blocks <= budget -> sinks + every candidate, exact
    assert sel.logical_blocks[1, 1].tolist() == [0, 1, -1, -1, -1, -1]


@pytest.mark.parametrize("strategy", ["gather", "all"])
def test_topk_oracle_matches_exact_attention_mass(strategy):
    summaries, table, keys, query, lengths = setup(12, 2)
    policy = make_policy("topk_oracle", strategy=strategy)
    assert policy.needs_keys
    scores = policy.block_scores(query, summaries, table, lengths, None)
    for r, n in enumerate(lengths.tolist()):
        ref = ref_mass(query[r], keys[r], n)
        torch.testing.assert_close(scores[r, :, :ref.shape[1]], ref, rtol=1e-4, atol=1e-5)
        assert torch.all(scores[r, :, ref.shape[1]:] == 0)
        torch.testing.assert_close(scores[r].sum(-1), torch.full((2,), 12.0))  # 1 per head


def test_h2o_accumulates_mass_over_queries_per_request():
    summaries, table, keys, query, lengths = setup(9, 3)
    second = torch.randn_like(query)
    third = torch.randn_like(query)
    policy = make_policy("h2o")
    states = [SelectionState(), None, SelectionState()]
    policy.block_scores(query, summaries, table, lengths, states)
    policy.observe(second, summaries, table, lengths, states)
    scores = policy.block_scores(third, summaries, table, lengths, states)
    for r, n in enumerate(lengths.tolist()):
        masses = [ref_mass(q[r], keys[r], n) for q in (query, second, third)]
        expected = masses[2] if states[r] is None else sum(masses)
        torch.testing.assert_close(scores[r, :, :expected.shape[1]], expected, rtol=1e-4, atol=1e-4)
    assert states[0].num_observed == 3 and states[0].nbytes() > 0


def test_h2o_state_grows_with_the_request():
    state = SelectionState()
    state.accumulate(torch.ones(2, 3))
    state.accumulate(torch.ones(2, 5))
    assert state.block_mass.tolist() == [[2, 2, 2, 1, 1]] * 2


def test_policy_errors():
    summaries, table, _, query, lengths = setup(4, 2)
    summaries.keys = None
    with pytest.raises(ValueError, match="keep_keys"):
        make_policy("topk_oracle").block_scores(query, summaries, table, lengths, None)
    with pytest.raises(ValueError, match="one per request"):
        make_policy("h2o").block_scores(query, summaries, table, lengths, SelectionState())
    with pytest.raises(ValueError, match="unknown selection policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="aggregation"):
        make_policy("quest", aggregation="mean")
    summaries.mins = None
    with pytest.raises(ValueError, match="keep_bounds"):
        make_policy("quest").block_scores(query, summaries, table, lengths, None)
    with pytest.raises(ValueError, match="factor"):
        make_policy("rerank", factor=0)
    with pytest.raises(ValueError, match="keep_keys"):
        make_policy("rerank").exact_scores(query, summaries, table[:, None, :1],
                                           table[:, :1], lengths[:, None])
    assert set(POLICIES) == {"retrieval", "quest", "streamingllm", "h2o", "topk_oracle",
                             "rerank"}
    # sorted: h2o, quest, rerank, retrieval, streamingllm, topk_oracle
    # rerank reads its keys from a key source (vLLM's cache in the engine), not the copy
    assert [POLICIES[n].needs_keys for n in sorted(POLICIES)] == [True, False, False, False,
                                                                  False, True]
    assert [POLICIES[n].needs_bounds for n in sorted(POLICIES)] == [False, True, False, False,
                                                                    False, False]


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
def test_quest_matches_reference(num_q, num_kv, aggregation):
    summaries, table, keys, query, lengths = setup(num_q, num_kv)
    scores = make_policy("quest", aggregation=aggregation).block_scores(
        query, summaries, table, lengths, None)
    assert scores.shape == (3, 2, table.shape[1])
    for r, n in enumerate(lengths.tolist()):
        ref = ref_quest(query[r], keys[r], n, aggregation)
        torch.testing.assert_close(scores[r, :, :n // BS], ref, rtol=1e-4, atol=1e-5)


def test_quest_bound_is_an_upper_bound_of_every_key_in_the_block():
    summaries, table, keys, query, lengths = setup(9, 3, seed=3)
    policy = make_policy("quest", aggregation="max")
    scores = policy.block_scores(query, summaries, table, lengths, None)  # [R, L, B]
    for r, n in enumerate(lengths.tolist()):
        k = keys[r][:, :n // BS * BS].repeat_interleave(3, dim=2)  # [L, n, Hq, D], GQA
        dots = torch.einsum("lhd,lthd->lht", query[r], k) / math.sqrt(8)  # [L, Hq, n]
        best = dots.amax(1).unflatten(-1, (n // BS, BS)).amax(-1)  # [L, n_full] best q.k
        assert torch.all(scores[r, :, :n // BS] >= best - 1e-5)


def test_quest_hand_worked_and_finds_the_outlier_key_mean_keys_miss():
    """One head, D = 2, block size 4. Block 0 holds one key aligned with q among three
    that cancel it in the mean; block 1 holds four mildly aligned keys.
    q = (1, -1): block 0 keys (4, 0), (-4, 0), (0, 2), (0, -2) -> mean (0, 0), q . mean 0;
    bounds min (-4, -2), max (4, 2): bound = max(1*-4, 1*4) + max(-1*-2, -1*2) = 4 + 2 = 6.
    Block 1 keys all (1, 0): mean (1, 0), q . mean = 1; bound = 1 + 0 = 1.
    Exact best q . k: block 0 has (4, 0) -> 4, block 1 -> 1. Quest ranks block 0 first
    (as the exact maximum does), the mean key ranks block 1 first."""
    from vllm_triforce.core.summaries import BlockSummaries

    s = BlockSummaries(1, 2, 1, 2, 4, keep_bounds=True)
    keys = torch.tensor([[4.0, 0], [-4, 0], [0, 2], [0, -2], [1, 0], [1, 0], [1, 0], [1, 0]])
    s.add_committed([keys], torch.arange(8), torch.tensor([0] * 4 + [1] * 4),
                    torch.arange(8) % 4)
    query = torch.tensor([1.0, -1.0]).view(1, 1, 1, 2)
    table, committed = torch.tensor([[0, 1]]), torch.tensor([8])
    quest = make_policy("quest", aggregation="max", scale=1.0).block_scores(
        query, s, table, committed, None)  # one head: max = the bound itself
    mean = make_policy("retrieval", scale=1.0).block_scores(query, s, table, committed, None)
    assert quest[0, 0].tolist() == [6.0, 1.0]
    assert mean[0, 0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
def test_shortlist_rescoring_scores_exactly_the_listed_blocks(aggregation):
    """Between middle rounds only a shortlist is re-ranked: its scores are block_scores' for
    those blocks (softmax: normalised over the list), every other block is -inf, and a
    shortlist of every candidate selects what a full scoring selects."""
    from vllm_triforce.core.selection import best_candidates
    summaries, table, keys, query, lengths = setup(12, 2, lengths=(37, 9, 29))
    policy = make_policy("retrieval", aggregation=aggregation)
    full = policy.block_scores(query, summaries, table, lengths, None)
    listed = best_candidates(full, lengths, geometry(BS, 4, 1, 1), size=3)  # [R, L, 3]
    assert listed.shape == (3, 2, 3)
    # request 1 (9 tokens: blocks 0, 1 full; sink 0, recent 1): no candidate at all
    assert listed[1].tolist() == [[-1, -1, -1]] * 2
    for r, n in enumerate(lengths.tolist()):
        for layer in range(2):
            cands = list(range(1, n // BS - 1))
            best = sorted(cands, key=lambda b: -float(full[r, layer, b]))[:3]
            assert [b for b in listed[r, layer].tolist() if b >= 0] == best
    new_query = torch.randn(query.shape, generator=torch.Generator().manual_seed(9))
    rescored = rescore_shortlist(policy, new_query, summaries, table, listed)
    again = policy.block_scores(new_query, summaries, table, lengths, None)
    for r in (0, 2):
        for layer in range(2):
            ids = listed[r, layer]
            mask = torch.zeros(table.shape[1], dtype=torch.bool)
            mask[ids] = True
            assert torch.all(rescored[r, layer, ~mask] == float("-inf"))
            if aggregation != "softmax":
                torch.testing.assert_close(rescored[r, layer, ids], again[r, layer, ids])
            else:  # each head's softmax over the listed blocks only, summed
                per_head = sum_scores(new_query, summaries, table)[r, layer]  # [Hq, B]
                torch.testing.assert_close(rescored[r, layer, ids],
                                           per_head[:, ids].softmax(-1).sum(0))
    everything = best_candidates(full, lengths, geometry(BS, 4, 1, 1), size=table.shape[1])
    rescored = rescore_shortlist(policy, new_query, summaries, table, everything)
    a = select_blocks(rescored, lengths, geometry(BS, 4, 1, 1))
    b = select_blocks(again, lengths, geometry(BS, 4, 1, 1))
    assert torch.equal(a.logical_blocks, b.logical_blocks)


@pytest.mark.parametrize("num_q,num_kv", [(12, 2), (4, 4)])
def test_rerank_of_every_candidate_is_the_exact_mass(num_q, num_kv):
    """rerank's second stage: with every candidate listed, each candidate's score is the
    Top-K oracle's exact mass (softmax over every committed key, sinks and tail included);
    with a short list, exactly the first stage's best candidates are scored, the rest -inf."""
    from vllm_triforce.core.blocks import candidate_mask
    from vllm_triforce.core.selection import best_candidates, rerank_exactly
    summaries, table, keys, query, lengths = setup(num_q, num_kv, lengths=(37, 9, 26),
                                                   squares=True)
    sinks, recent = 1, 1
    first = make_policy("rerank").block_scores(query, summaries, table, lengths)
    torch.testing.assert_close(first, make_policy("retrieval", variance=True).block_scores(
        query, summaries, table, lengths))
    # num_retrieved = budget - sinks - recent - 1: 1, then 2
    every = rerank_exactly(make_policy("rerank", factor=100), first, query, summaries, table,
                           lengths, geometry(BS, 4, sinks, recent))
    cand = candidate_mask(lengths, table.shape[1], geometry(BS, 4, sinks, recent))
    assert cand.sum(1).tolist() == [7, 0, 4]
    for r, n in enumerate(lengths.tolist()):
        ref = ref_mass(query[r], keys[r], n)  # [L, ceil(n / BS)]
        is_cand = cand[r, :ref.shape[1]]
        torch.testing.assert_close(every[r, :, :ref.shape[1]][:, is_cand], ref[:, is_cand])
        assert torch.all(every[r][:, ~cand[r]] == float("-inf"))
    short = rerank_exactly(make_policy("rerank", factor=1), first, query, summaries, table,
                           lengths, geometry(BS, 5, sinks, recent))
    listed = best_candidates(first, lengths, geometry(BS, 5, sinks, recent), size=2)
    for r in range(3):
        for layer in range(2):
            ids = [b for b in listed[r, layer].tolist() if b >= 0]
            assert torch.isfinite(short[r, layer]).nonzero().flatten().tolist() == sorted(ids)


def sum_scores(query, summaries, table):
    """[R, L, Hq, B] each query head's own q . mean key / sqrt(D) (one head at a time)."""
    policy = make_policy("retrieval", aggregation="sum")
    heads = []
    for h in range(query.shape[2]):
        alone = torch.zeros_like(query)
        alone[:, :, h] = query[:, :, h]
        heads.append(policy.block_scores(alone, summaries, table, torch.tensor([0] * len(table))))
    return torch.stack(heads, dim=2)


def test_only_mean_key_policies_rerank_a_shortlist():
    assert make_policy("retrieval").reranks_shortlist
    for name in ("quest", "streamingllm", "h2o", "topk_oracle"):
        policy = make_policy(name)
        assert not policy.reranks_shortlist
        with pytest.raises(NotImplementedError, match=name):
            policy.shortlist_scores(None, None, None)


def ref_variance_scores(query, keys, n, aggregation):
    """Mean + variance, per query head: q . mu / sqrt(D) + 1/2 sum_d q_d^2 var_d / D (the log
    of E[exp(q . k / sqrt(D))] for keys with that per-channel mean and variance, channels
    independent) -> [L, n_full]."""
    def score(q, block, *_):
        return float(q @ block.mean(0) + 0.5 * (q * q) @ block.var(0, unbiased=False))
    return ref_per_block(query, keys, n, aggregation, score)


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
def test_retrieval_with_variance_matches_reference(num_q, num_kv, aggregation):
    summaries, table, keys, query, lengths = setup(num_q, num_kv, squares=True)
    policy = make_policy("retrieval", aggregation=aggregation, variance=True)
    assert policy.needs_variance and policy.reranks_shortlist
    assert_scores_match(policy, summaries, table, keys, query, lengths, aggregation,
                        ref_variance_scores)


def assert_scores_match(policy, summaries, table, keys, query, lengths, aggregation, ref):
    """`policy`'s block scores equal `ref`'s per request, and (but for softmax) a
    shortlist's re-ranking gives its blocks the same scores."""
    from vllm_triforce.core.selection import best_candidates
    scores = policy.block_scores(query, summaries, table, lengths, None)
    for r, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(scores[r, :, :n // BS], ref(query[r], keys[r], n, aggregation),
                                   rtol=1e-4, atol=1e-5)
    if aggregation == "softmax":
        return
    listed = best_candidates(scores, lengths, geometry(BS, 4, 1, 1), size=3)
    rescored = rescore_shortlist(policy, query, summaries, table, listed)
    for r in (0, 2):
        for layer in range(2):
            ids = listed[r, layer]
            torch.testing.assert_close(rescored[r, layer, ids], scores[r, layer, ids])


# head_dim 8 in 2 bands of whole rotation pairs (core/summaries.py): channels 0, 1, 4, 5
# and 2, 3, 6, 7
BANDS_OF_8 = ([0, 1, 4, 5], [2, 3, 6, 7])


def ref_channel_profile(keys, lengths):
    """keys: per request [L, n, H, D] -> [L, H, D]: each channel's squared deviations from
    its block's mean, summed over every committed block, partial ones too."""
    profile = 0.0
    for k, n in zip(keys, lengths):
        for lo in range(0, n, BS):
            block = k[:, lo:lo + BS]  # [L, t, H, D]
            profile = profile + (block - block.mean(1, keepdim=True)).square().sum(1)
    return profile


def ref_compact_variance_scores(profile):
    """Mean + compact variance, per query head: q . mu / sqrt(D) + 1/2 sum over bands of the
    sum of its channels' variances x their q_d^2 / D, each weighed by its share of the band
    in the channel `profile` [L, H, D] -> ref(query, keys, n, aggregation) [L, n_full]."""
    def score(q, block, layer, head):
        var, weight = block.var(0, unbiased=False), profile[layer, head]
        bands = sum(float((q[b] * q[b] * weight[b]).sum() / weight[b].sum() * var[b].sum())
                    for b in BANDS_OF_8)
        return float(q @ block.mean(0)) + 0.5 * bands
    return lambda query, keys, n, aggregation: ref_per_block(query, keys, n, aggregation, score)


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (4, 4)])
@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
@pytest.mark.parametrize("strategy", ["gather", "all"])
def test_retrieval_with_compact_variance_matches_reference(num_q, num_kv, aggregation,
                                                           strategy):
    """A compact variance (2 bands of 4 channels) is scored as the reference does, by
    `block_scores` with either read, and by a shortlist's re-ranking."""
    summaries, table, keys, query, lengths = setup(num_q, num_kv, squares=True, compact=True)
    assert summaries.deviations().shape[-1] == 2
    profile = ref_channel_profile(keys, lengths.tolist())
    torch.testing.assert_close(summaries.channel_profile, profile, rtol=1e-4, atol=1e-4)
    policy = make_policy("retrieval", aggregation=aggregation, strategy=strategy,
                         variance=True)
    assert_scores_match(policy, summaries, table, keys, query, lengths, aggregation,
                        ref_compact_variance_scores(profile))


# 6 full blocks of 2 layers x 2 KV heads x 8 channels, read in two orders
BAND_TABLE = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4]])
BAND_COMMITTED = torch.tensor([6 * BS, 6 * BS])


def per_channel_and_compact(keys):
    """keys [2, 6 * BS, 2, 8] committed to a per-channel and a compact store (2 bands)."""
    from vllm_triforce.core.summaries import BlockSummaries
    stores = (BlockSummaries(2, 6, 2, 8, BS, keep_variance=True),
              BlockSummaries(2, 6, 2, 8, BS, keep_variance=True, compact_variance=True))
    rows = torch.arange(6 * BS)
    for s in stores:
        s.add_committed([keys[l].flatten(1) for l in range(2)], rows, rows // BS, rows % BS)
    return stores


def test_compact_variance_scores_as_per_channel_where_a_band_shares_one_variance():
    """Keys whose channels of a band vary alike (the same deviations in each): the compact
    score equals the per-channel one, from the store, a shortlist and its copy."""
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(2, 6 * BS, 2, 8, generator=gen)  # [L, T, H, D]
    wobble = torch.randn(2, 6 * BS, 2, 2, generator=gen)  # one per band
    per_channel, compact = per_channel_and_compact(
        base.mean(1, keepdim=True) + wobble[..., [0, 0, 1, 1, 0, 0, 1, 1]])
    query, table = torch.randn(2, 2, 4, 8, generator=gen), BAND_TABLE
    policy = make_policy("retrieval", variance=True)
    expected = policy.block_scores(query, per_channel, table, BAND_COMMITTED)
    torch.testing.assert_close(policy.block_scores(query, compact, table, BAND_COMMITTED),
                               expected)
    listed = table[:, None, :4].expand(2, 2, 4)
    rows, counts = compact.layer_rows(listed), compact.counts[listed].float()
    copy = policy.listed_copy(compact, rows, counts)
    assert copy.shape == (2, 2, 4, 2 * 8 + 2 * 2)
    for scores in (policy.shortlist_scores(query, compact, listed),
                   policy.shortlist_scores(query, compact, listed, copy=copy)):
        torch.testing.assert_close(scores, expected[:, :, :4])


def test_compact_variance_scores_as_per_channel_where_blocks_split_a_band_as_the_profile():
    """Keys whose channels of a band vary alike but at channels' own scales (channel 0 ten
    times the rest: a head's outlier channel, in every block): each block's M2 splits among
    a band's channels as the channel profile does, so the compact score equals the
    per-channel one; weighed by the band's mean q_d^2 instead, it would not."""
    gen = torch.Generator().manual_seed(11)
    wobble = torch.randn(2, 6 * BS, 2, 2, generator=gen)[..., [0, 0, 1, 1, 0, 0, 1, 1]]
    scale = torch.tensor([10.0, 1, 1, 1, 1, 1, 1, 1])
    per_channel, compact = per_channel_and_compact(
        torch.randn(2, 1, 2, 8, generator=gen) + wobble * scale)
    query, table = torch.randn(2, 2, 4, 8, generator=gen), BAND_TABLE
    policy = make_policy("retrieval", variance=True)
    expected = policy.block_scores(query, per_channel, table, BAND_COMMITTED)
    torch.testing.assert_close(policy.block_scores(query, compact, table, BAND_COMMITTED),
                               expected)
    flat = per_channel.with_compact_variance(profile=False)  # each band by its mean weight
    torch.testing.assert_close(flat.deviations(), compact.deviations())
    assert not torch.allclose(policy.block_scores(query, flat, table, BAND_COMMITTED), expected)


def test_variance_finds_the_outlier_key_the_mean_dilutes():
    """Block 1 holds one key far along the query among small ones; block 2 holds keys
    uniformly mild. Exact attention mass favours block 1; the mean key favours block 2;
    mean + variance ranks block 1 first."""
    from vllm_triforce.core.summaries import BlockSummaries
    s = BlockSummaries(1, 3, 1, 2, BS, keep_variance=True)
    keys = torch.zeros(3 * BS, 2)
    keys[BS] = torch.tensor([6.0, 0.0])  # block 1: one outlier
    keys[2 * BS:3 * BS] = torch.tensor([2.0, 0.0])  # block 2: uniform
    rows = torch.arange(3 * BS)
    s.add_committed([keys], rows, rows // BS, rows % BS)
    query = torch.tensor([[[[2.0, 0.0]]]])  # [R, L, Hq, D]
    table, committed = torch.tensor([[0, 1, 2]]), torch.tensor([3 * BS])
    mass = (keys[:, 0] * 2.0 / math.sqrt(2)).softmax(0).view(3, BS).sum(1)
    assert int(mass.argmax()) == 1
    mean = make_policy("retrieval").block_scores(query, s, table, committed)
    assert int(mean[0, 0].argmax()) == 2
    both = make_policy("retrieval", variance=True).block_scores(query, s, table, committed)
    assert int(both[0, 0].argmax()) == 1


def integer_summaries(num_blocks=13, num_kv=2, head_dim=8, dtype=torch.float32):
    """BlockSummaries whose sums, variances and counts are small integers (exact in bf16),
    so every dot product is exact whatever order a kernel sums in."""
    from vllm_triforce.core.summaries import BlockSummaries
    gen = torch.Generator().manual_seed(3)
    s = BlockSummaries(2, num_blocks, num_kv, head_dim, BS, dtype=dtype, keep_variance=True)
    s.sums.copy_(torch.randint(-4, 5, s.sums.shape, generator=gen))
    s.square_deviations.copy_(torch.randint(0, 9, s.sums.shape, generator=gen))
    s.counts.copy_(torch.randint(1, BS + 1, (num_blocks,), generator=gen))
    return s


def test_block_chunks_bound_the_float32_copy(monkeypatch):
    from vllm_triforce.core import reads
    store = torch.zeros(32, 1100, 8, 128, dtype=torch.bfloat16)  # 128 KiB per block in fp32
    assert [c.stop - c.start for c in reads.block_chunks(store)] == [512, 512, 512]
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 3 * 32 * 8 * 128 * 4 + 1)
    chunks = reads.block_chunks(store)
    assert len(chunks) == 367 and chunks[-1] == slice(1098, 1101)  # 3 blocks, the last 2
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 1)  # a block alone is over: 1 each
    assert len(reads.block_chunks(store)) == 1100


@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
@pytest.mark.parametrize("variance", [False, True])
def test_all_blocks_scored_in_chunks_equal_one_chunk(monkeypatch, aggregation, variance):
    """Chunks of 2 blocks (the last one short) of a bf16 store give the scores of a float32
    store of the same values (read whole, in place) bit for bit."""
    from vllm_triforce.core import reads
    table = torch.tensor([[3, 0, 12, 7], [5, 5, 1, 11]])
    query = torch.randint(-3, 4, (2, 2, 6, 8), generator=torch.Generator().manual_seed(4))
    policy = make_policy("retrieval", aggregation=aggregation, strategy="all", scale=1.0,
                         variance=variance)
    committed = torch.tensor([4 * BS, 3 * BS])
    one_chunk = policy.block_scores(query.float(), integer_summaries(), table, committed)
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 2 * 2 * 2 * 8 * 4)  # 2 blocks
    for dtype in (torch.float32, torch.bfloat16):
        summaries = integer_summaries(dtype=dtype)
        assert len(reads.score_chunks(summaries.sums)) == (1 if dtype == torch.float32
                                                           else 7)
        chunked = policy.block_scores(query.float(), summaries, table, committed)
        assert torch.equal(chunked, one_chunk)


@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
@pytest.mark.parametrize("variance", [False, True])
def test_gathered_blocks_scored_in_chunks_equal_one_gather(monkeypatch, aggregation, variance):
    """The "gather" strategy reads a request's blocks by `gather_chunks` (a gathered float32
    copy of at most SCORE_CHUNK_BYTES, not all of a 128K request's blocks at once): chunks of
    one table column (2 requests' blocks) give the scores of one gather, bit for bit."""
    from vllm_triforce.core import reads
    table = torch.tensor([[3, 0, 12, 7], [5, 5, 1, 11]])
    query = torch.randint(-3, 4, (2, 2, 6, 8), generator=torch.Generator().manual_seed(4))
    policy = make_policy("retrieval", aggregation=aggregation, strategy="gather", scale=1.0,
                         variance=variance)
    committed = torch.tensor([4 * BS, 3 * BS])
    summaries = integer_summaries(dtype=torch.bfloat16)
    one_gather = policy.block_scores(query.float(), summaries, table, committed)
    assert len(reads.gather_chunks(summaries.sums, table)) == 1
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 2 * 2 * 2 * 8 * 4)  # one column
    assert len(reads.gather_chunks(summaries.sums, table)) == 4
    assert torch.equal(policy.block_scores(query.float(), summaries, table, committed),
                       one_gather)
    store = torch.zeros(32, 1, 8, 128, dtype=torch.bfloat16)  # a block of Llama-3.1-8B
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 64 * 2**20)
    chunks = reads.gather_chunks(store, torch.zeros(1, 8192, dtype=torch.long))  # 128K
    assert [c.stop - c.start for c in chunks] == [512] * 16


@pytest.mark.parametrize("aggregation", ["sum", "max", "softmax"])
@pytest.mark.parametrize("variance", [False, True])
def test_shortlist_scored_in_chunks_equal_one_gather(monkeypatch, aggregation, variance):
    """Between middle rounds a shortlist [R, L, S] is read by `gather_chunks` of S: chunks of
    one listed block per layer give the scores of one gather, bit for bit, and match the
    same blocks scored by `block_scores`."""
    from vllm_triforce.core import reads
    listed = torch.tensor([[[3, 0, 12, -1], [7, 3, 1, 0]], [[5, 1, 11, 2], [2, 11, -1, -1]]])
    query = torch.randint(-3, 4, (2, 2, 6, 8), generator=torch.Generator().manual_seed(4))
    policy = make_policy("retrieval", aggregation=aggregation, scale=1.0, variance=variance)
    summaries = integer_summaries(dtype=torch.bfloat16)
    one_gather = policy.shortlist_scores(query.float(), summaries, listed)
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", 2 * 2 * 2 * 8 * 4)  # one block
    assert len(reads.gather_chunks(summaries.sums, listed[:, 0])) == 4
    chunked = policy.shortlist_scores(query.float(), summaries, listed)
    assert torch.equal(chunked, one_gather)
    if aggregation == "sum":  # linear: the same numbers as scoring the blocks in a table
        full = policy.block_scores(query.float(), summaries, listed[:, 0].clamp(min=0),
                                   torch.tensor([4 * BS, 4 * BS]))
        assert torch.allclose(chunked[:, 0], full[:, 0])


@pytest.mark.parametrize("variance", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shortlist_copy_scores_as_the_store_reads(monkeypatch, variance, dtype):
    """Between middle rounds the listed blocks' summaries are copied once (`listed_copy`:
    mean keys, then variances, divided by the counts) and re-ranked from the copy: the same
    scores as reading the stores (to float32 rounding), padding included; no copy where
    it would pass SCORE_CHUNK_BYTES or for a per-head aggregation."""
    from vllm_triforce.core import reads
    listed = torch.tensor([[[3, 0, 12, -1], [7, 3, 1, 0]], [[5, 1, 11, 2], [2, 11, -1, -1]]])
    query = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(4))
    policy = make_policy("retrieval", variance=variance)
    summaries = integer_summaries(dtype=dtype)
    rows = summaries.layer_rows(listed)
    counts = summaries.counts[listed.clamp(min=0)].clamp(min=1).float()
    copy = policy.listed_copy(summaries, rows, counts)
    assert copy.shape == (2, 2, 4, (1 + variance) * 2 * 8) and copy.dtype == torch.float32
    read = policy.shortlist_scores(query, summaries, listed, rows=rows, counts=counts)
    copied = policy.shortlist_scores(query, summaries, listed, copy=copy)
    torch.testing.assert_close(copied, read)
    monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", copy.nbytes - 1)
    assert policy.listed_copy(summaries, rows, counts) is None
    per_head = make_policy("retrieval", aggregation="max", variance=variance)
    assert per_head.listed_copy(summaries, rows, counts) is None
