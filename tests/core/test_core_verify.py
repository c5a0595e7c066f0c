"""verify / sampling_probs: hand-worked cases, guards, reproducibility."""

import math

import pytest
import torch

from vllm_triforce.core.verify import sampling_probs, verify, verify_greedy


def one_hot(token, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def ref_filter(logits, temperature, k, p):
    """Brute force, vLLM's formulation (ascending sort, drop while cumulative <= 1 - p)."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: x[i])
    if 0 < k < len(x):
        kth = sorted(x, reverse=True)[k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if p < 1:
        probs = torch.tensor(x).softmax(0).tolist()
        cum = 0.0
        for rank, i in enumerate(order):
            cum += probs[i]
            if cum <= 1 - p and rank < len(x) - 1:
                x[i] = -math.inf
    return torch.tensor(x).softmax(0)


def test_sampling_probs_hand_worked():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 5))
    probs = sampling_probs(logits, torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]),
                           top_k=torch.tensor([0, 0, 2, 0, 1]),
                           top_p=torch.tensor([0.6, 0.5, 1.0, 1.0, 1.0]))
    expected = [[0.625, 0.375, 0.0], [1.0, 0.0, 0.0], [0.625, 0.375, 0.0], [1.0, 0.0, 0.0],
                [1.0, 0.0, 0.0]]
    torch.testing.assert_close(probs, torch.tensor(expected))
    assert probs.dtype == torch.float32


def test_sampling_probs_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 11, generator=gen) * 3
    logits[5, 2] = logits[5, 7]  # a tie at the top-k boundary region
    temperature = torch.rand(40, generator=gen) + 0.3
    top_k = torch.randint(-1, 13, (40,), generator=gen)
    top_p = torch.rand(40, generator=gen) * 1.2
    probs = sampling_probs(logits, temperature, top_k, top_p)
    for i in range(40):
        ref = ref_filter(logits[i].tolist(), float(temperature[i]), int(top_k[i]), float(top_p[i]))
        torch.testing.assert_close(probs[i], ref, rtol=1e-5, atol=1e-6)


def test_sampling_probs_nan_safe():
    logits = torch.tensor([[float("nan"), 1.0, 2.0], [float("nan")] * 3, [float("inf"), 0.0, 1.0]])
    probs = sampling_probs(logits, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([0.9, 1.0, 1.0]))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert probs[0, 0] == 0 and probs[2, 0] == 1
    torch.testing.assert_close(probs[1], torch.full((3,), 1 / 3))


def test_verify_hand_worked():
    # row 0: drafts [1, 2, 3]; p puts all mass on 1 then on 4 -> accept 1, reject 2, recover 4
    # row 1: every draft certain under p -> all accepted, bonus from p[3] (certain 0)
    # row 2: only 1 valid draft -> accepted, bonus from p[1]
    # row 3: no drafts -> one token from p[0]
    target = torch.stack([
        torch.stack([one_hot(1), one_hot(4), one_hot(3), one_hot(0)]),
        torch.stack([one_hot(1), one_hot(2), one_hot(3), one_hot(0)]),
        torch.stack([one_hot(1), one_hot(2), one_hot(0), one_hot(0)]),
        torch.stack([one_hot(3), one_hot(2), one_hot(0), one_hot(0)]),
    ])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 0, 0], [0, 0, 0]])
    res = verify(drafts, None, target, torch.tensor([3, 3, 1, 0]), torch.zeros(4, dtype=torch.bool))
    assert res.output_token_ids.tolist() == [[1, 4, -1, -1], [1, 2, 3, 0], [1, 2, -1, -1],
                                            [3, -1, -1, -1]]
    assert res.num_accepted.tolist() == [1, 3, 1, 0]
    assert (res.num_accepted + 1).tolist() == [2, 4, 2, 1]  # tokens emitted


def test_verify_greedy_rows():
    target = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.3, 0.5], [0.7, 0.2, 0.1]]] * 2)
    drafts = torch.tensor([[1, 2], [1, 0]])
    draft_probs = torch.tensor([[[0.0, 0.9, 0.1], [0.0, 0.1, 0.9]]] * 2)
    res = verify(drafts, draft_probs, target, torch.tensor([2, 2]), torch.tensor([True, True]))
    assert res.output_token_ids.tolist() == [[1, 2, 0], [1, 2, -1]]


def test_zero_residual_falls_back_to_target():
    # proposal q = one-hot(1) but p(1) = 0.5 with no other mass (e.g. rounding): when the
    # draft is rejected the residual max(p - q, 0) is all zero -> sample from p -> 1
    target = torch.tensor([[[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]]).expand(200, -1, -1)
    res = verify(torch.ones(200, 1, dtype=torch.long), None, target, torch.ones(200, dtype=torch.long),
                 torch.zeros(200, dtype=torch.bool))
    rejected = res.num_accepted == 0
    assert 50 < int(rejected.sum()) < 150
    assert torch.all(res.output_token_ids[rejected, 0] == 1)


def test_nan_target_probs_are_guarded():
    target = torch.tensor([[[float("nan"), 1.0, 0.0], [0.0, 0.0, 1.0]]])
    res = verify(torch.tensor([[1]]), None, target, torch.tensor([1]), torch.tensor([False]))
    assert res.output_token_ids.tolist() == [[1, 2]]


def test_seeded_generators_are_reproducible():
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(6, 4, 50, generator=gen).softmax(-1)
    draft_probs = torch.rand(6, 3, 50, generator=gen).softmax(-1)
    drafts = torch.randint(0, 50, (6, 3), generator=gen)
    args = (drafts, draft_probs, target, torch.full((6,), 3), torch.zeros(6, dtype=torch.bool))

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(6)]
        return verify(*args, generators=gens).output_token_ids

    assert torch.equal(run(1), run(1))
    assert not all(torch.equal(run(1), run(s)) for s in (2, 3, 4))
    with pytest.raises(ValueError):
        verify(*args, generators=[None])


def test_final_token_follows_its_distribution():
    # no drafts: each row's one token is drawn from p itself (unnormalised here), by the
    # inverse CDF; zero-mass tokens are never drawn, the others within 5 standard errors
    rows = 40000
    p = torch.tensor([0.0, 1.0, 0.0, 0.6, 0.4, 0.0]) * 2
    torch.manual_seed(0)
    res = verify(torch.zeros(rows, 0, dtype=torch.long), None, p.expand(rows, 1, -1),
                 torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool))
    counts = torch.bincount(res.output_token_ids[:, 0], minlength=6).double()
    expected = p.double() / p.sum() * rows
    assert counts[p == 0].sum() == 0
    se = (expected * (1 - expected / rows)).sqrt()
    assert torch.all((counts - expected).abs()[p > 0] < 5 * se[p > 0]), counts.tolist()


def test_all_greedy_batch_on_the_host_draws_nothing():
    target = torch.rand(3, 3, 7).softmax(-1)
    drafts = torch.randint(0, 7, (3, 2))
    args = (drafts, None, target, torch.full((3,), 2))
    state = torch.get_rng_state()
    greedy = verify(*args, torch.ones(3, dtype=torch.bool))
    assert torch.equal(torch.get_rng_state(), state)  # the fast path: no draw at all
    expected = target.argmax(-1)
    for row in range(3):
        n = int(greedy.num_accepted[row])
        assert drafts[row, :n].tolist() == expected[row, :n].tolist()
        assert n == 2 or int(drafts[row, n]) != int(expected[row, n])
        assert int(greedy.output_token_ids[row, n]) == int(expected[row, n])
    verify(*args, torch.tensor([True, False, True]))
    assert not torch.equal(torch.get_rng_state(), state)


def test_verify_greedy_equals_the_general_path_on_greedy_rows():
    gen = torch.Generator().manual_seed(3)
    target = torch.rand(9, 4, 11, generator=gen).softmax(-1)
    argmax = target.argmax(-1)
    drafts = argmax[:, :3].clone()
    drafts[torch.arange(9), torch.arange(9) % 3] += 1  # one mismatch per row, somewhere
    drafts[::4] = argmax[::4, :3]  # ... or none
    drafts %= 11
    num_drafts = torch.tensor([3, 2, 3, 1, 0, 3, 3, 2, 3])
    mixed = torch.ones(9, dtype=torch.bool)
    mixed[-1] = False  # one sampled row keeps verify on its general path
    general = verify(drafts, None, target, num_drafts, mixed)
    fast = verify_greedy(drafts, argmax, num_drafts)
    assert torch.equal(fast.output_token_ids[:-1], general.output_token_ids[:-1])
    assert torch.equal(fast.num_accepted[:-1], general.num_accepted[:-1])
    assert 0 < int(fast.num_accepted.sum()) < int(num_drafts.sum())


def test_verify_greedy_without_drafts_emits_the_argmax():
    """Two levels: a round proposes nothing and emits the retrieval level's own argmax
    (verify_greedy's early return), as the general path does for greedy rows."""
    gen = torch.Generator().manual_seed(4)
    target = torch.rand(5, 1, 13, generator=gen).softmax(-1)
    drafts = torch.zeros(5, 0, dtype=torch.long)
    general = verify(drafts, None, target, torch.zeros(5, dtype=torch.long),
                     torch.ones(5, dtype=torch.bool))
    fast = verify_greedy(drafts, target.argmax(-1), torch.zeros(5, dtype=torch.long))
    assert torch.equal(fast.output_token_ids, general.output_token_ids)
    assert torch.equal(fast.num_accepted, general.num_accepted)
    assert fast.output_token_ids.shape == (5, 1) and not fast.num_accepted.any()
