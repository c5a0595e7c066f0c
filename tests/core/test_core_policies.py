"""Every selection policy against a brute-force reference written here."""

import math

import pytest
import torch

from core_toys import make_pool
from vllm_triforce.core.selection import (POLICIES, SelectionState, make_policy, select_blocks)

BS = 4


def ref_retrieval(query, keys, n, aggregation):
    """query [L, Hq, D], keys [L, n, Hkv, D] of one request -> [L, n_full] by loops."""
    num_layers, num_q, dim = query.shape
    group = num_q // keys.shape[2]
    n_full = n // BS
    out = torch.zeros(num_layers, n_full)
    for layer in range(num_layers):
        for h in range(num_q):
            per_block = torch.tensor([
                float(query[layer, h] @ keys[layer, b * BS:(b + 1) * BS, h // group].mean(0))
                / math.sqrt(dim) for b in range(n_full)])
            out[layer] += per_block.softmax(0) if aggregation == "softmax" else per_block
    return out


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


def setup(num_q, num_kv, lengths=(37, 9, 24), seed=0):
    summaries, table, keys = make_pool(list(lengths), num_layers=2, num_kv_heads=num_kv,
                                       head_dim=8, block_size=BS, seed=seed)
    query = torch.randn(len(lengths), 2, num_q, 8, generator=torch.Generator().manual_seed(seed + 1))
    return summaries, table, keys, query, torch.tensor(lengths)


@pytest.mark.parametrize("num_q,num_kv", [(14, 2), (12, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("aggregation", ["sum", "softmax"])
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
    sel = select_blocks(scores, lengths, BS, budget_blocks=8, num_sink_blocks=2, num_recent_blocks=2)
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
        make_policy("quest")
    assert set(POLICIES) == {"retrieval", "streamingllm", "h2o", "topk_oracle"}
    assert [POLICIES[n].needs_keys for n in sorted(POLICIES)] == [True, False, False, True]
