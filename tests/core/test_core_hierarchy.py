"""Chi-square tests: speculative sampling returns the target's distribution at one
level and through the two-level hierarchy (tiny draft -> middle -> target).

Toy "models" are bigram tables [V + 1, V]: row c is the next-token distribution after
token c (row V = start of sequence). Each test generates the first N_OUT tokens of
N_SEQ independent sequences, batched as rows, and compares the joint distribution of
those tokens with the target's exact joint (all cells have expected count >= 5).
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from vllm_triforce.core.verify import verify

N_SEQ = 20000
P_PASS = 1e-3  # fixed seeds: the correct sampler's p-values are far from this


def bigram(vocab, seed, floor=0.3):
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(vocab + 1, vocab, generator=gen) * 1.5).softmax(-1)
    return (1 - floor) * probs + floor / vocab


def append(out, count, res, active):
    """Write each active row's emitted tokens after its `count` tokens."""
    emitted = torch.where(active, res.num_accepted + 1, 0)
    for j in range(res.output_token_ids.shape[1]):
        rows = torch.nonzero(j < emitted).squeeze(1)
        if rows.numel():
            out[rows, count[rows] + j] = res.output_token_ids[rows, j]
    last = res.output_token_ids.gather(1, res.num_accepted[:, None]).squeeze(1)
    return count + emitted, last


def propose(table, ctx, gamma, gen):
    """Sample gamma tokens autoregressively: ids [R, gamma], their distributions [R, gamma, V]."""
    ids, probs = [], []
    for _ in range(gamma):
        p = table[ctx]
        ctx = torch.multinomial(p, 1, generator=gen).squeeze(1)
        ids.append(ctx)
        probs.append(p)
    return torch.stack(ids, 1), torch.stack(probs, 1)


def run_level(ctx, n_tokens, propose_fn, upper, verify_fn, one_hot_drafts=False):
    """Generate n_tokens per row with speculative steps of the lower level against the
    `upper` table. Returns ids [R, n_tokens] and the upper level's probs at each of
    them: the distribution every emitted token was drawn from (handed upward)."""
    num_rows = ctx.shape[0]
    out = torch.full((num_rows, n_tokens + 16), -1, dtype=torch.long)
    count, cur = torch.zeros(num_rows, dtype=torch.long), ctx
    while int(count.min()) < n_tokens:
        draft_ids, draft_probs = propose_fn(cur)
        gamma = draft_ids.shape[1]
        p = upper[torch.cat([cur[:, None], draft_ids], 1)]  # [R, gamma + 1, V]
        res = verify_fn(draft_ids, None if one_hot_drafts else draft_probs, p,
                        torch.full((num_rows,), gamma), torch.zeros(num_rows, dtype=torch.bool))
        count, cur = append(out, count, res, count < n_tokens)
    ids = out[:, :n_tokens]
    return ids, upper[torch.cat([ctx[:, None], ids[:, :-1]], 1)]


def buggy_middle_verify(draft_ids, draft_probs, p, num_drafts, greedy):
    """The reference code's Middle_Spec: on rejection it samples from p, not the residual."""
    res = verify(draft_ids, draft_probs, p, num_drafts, greedy)
    rejected = torch.nonzero(res.num_accepted < num_drafts).squeeze(1)
    at = res.num_accepted[rejected]
    res.output_token_ids[rejected, at] = torch.multinomial(p[rejected, at], 1).squeeze(1)
    return res


def hierarchy(draft, middle, target, n_out, gamma1, gamma2, middle_verify=verify,
              one_hot_drafts=False, seed=0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = target.shape[1]
    bos = torch.full((N_SEQ,), vocab)

    def propose_middle(ctx):
        return run_level(ctx, gamma2, lambda c: propose(draft, c, gamma1, gen), middle,
                         middle_verify, one_hot_drafts)

    ids, _ = run_level(bos, n_out, propose_middle, target, verify)
    return ids


def one_level(draft, target, n_out, gamma, seed=0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bos = torch.full((N_SEQ,), target.shape[1])
    ids, _ = run_level(bos, n_out, lambda c: propose(draft, c, gamma, gen), target, verify)
    return ids


def chi_square_pvalue(ids, target):
    """p-value of the observed joint of the rows of ids against the target's exact joint."""
    vocab, n_out = target.shape[1], ids.shape[1]
    observed, expected = [], []
    counts = torch.bincount((ids * vocab ** torch.arange(n_out - 1, -1, -1)).sum(1),
                            minlength=vocab ** n_out)
    for cell, seq in enumerate(itertools.product(range(vocab), repeat=n_out)):
        prob, prev = 1.0, vocab
        for token in seq:
            prob *= float(target[prev, token])
            prev = token
        observed.append(int(counts[cell]))
        expected.append(prob)
    expected = [e / sum(expected) * ids.shape[0] for e in expected]  # float32 tables: renormalise
    assert min(expected) >= 5
    return chisquare(observed, expected).pvalue


def test_one_level_preserves_target_distribution():
    draft, target = bigram(3, 1), bigram(3, 2)
    ids = one_level(draft, target, n_out=3, gamma=2)
    assert chi_square_pvalue(ids, target) > P_PASS


def test_two_levels_preserve_target_distribution():
    draft, middle, target = bigram(3, 3), bigram(3, 4), bigram(3, 5)
    ids = hierarchy(draft, middle, target, n_out=3, gamma1=2, gamma2=2)
    assert chi_square_pvalue(ids, target) > P_PASS


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_draft_always_a_middle_and_target_fifty_fifty(one_hot_drafts):
    """Draft always a, middle = target = (1/2, 1/2): the output must be 50/50. The reference
    code's middle level, resampling a rejection from p instead of the residual, emits a with
    1/2 + 1/2 * 1/2 = 3/4, and the full level accepts every token (p_t / p_middle = 1): 75/25.
    The same test run on the buggy variant must fail."""
    draft = torch.tensor([[1.0, 0.0]] * 3)  # always proposes a = token 0
    fifty = torch.full((3, 2), 0.5)
    ids = hierarchy(draft, fifty, fifty, n_out=2, gamma1=1, gamma2=2, one_hot_drafts=one_hot_drafts)
    assert chi_square_pvalue(ids, fifty) > P_PASS
    buggy = hierarchy(draft, fifty, fifty, n_out=2, gamma1=1, gamma2=2,
                      middle_verify=buggy_middle_verify, one_hot_drafts=one_hot_drafts)
    assert chi_square_pvalue(buggy, fifty) < 1e-9
    assert abs(float((buggy[:, 0] == 0).float().mean()) - 0.75) < 0.02


def test_buggy_middle_also_fails_on_random_models():
    draft, middle, target = bigram(3, 6, floor=0.05), bigram(3, 7), bigram(3, 8)
    buggy = hierarchy(draft, middle, target, n_out=2, gamma1=2, gamma2=2,
                      middle_verify=buggy_middle_verify)
    assert chi_square_pvalue(buggy, target) < 1e-9
    ids = hierarchy(draft, middle, target, n_out=2, gamma1=2, gamma2=2)
    assert chi_square_pvalue(ids, target) > P_PASS


def test_greedy_hierarchy_equals_target_argmax_chain():
    vocab, gen = 5, torch.Generator().manual_seed(9)
    draft, middle, target = bigram(vocab, 10), bigram(vocab, 11), bigram(vocab, 12)
    num_rows, greedy = 64, torch.ones(64, dtype=torch.bool)
    ctx = torch.randint(0, vocab + 1, (num_rows,), generator=gen)
    draft_ids, draft_probs = propose(draft, ctx, 3, gen)
    mid = verify(draft_ids, draft_probs, middle[torch.cat([ctx[:, None], draft_ids], 1)],
                 torch.full((num_rows,), 3), greedy)
    # the middle's emitted tokens are the full level's drafts (num_drafts = emitted)
    ids = mid.output_token_ids.clamp(min=0)
    res = verify(ids, None, target[torch.cat([ctx[:, None], ids], 1)], mid.num_accepted + 1, greedy)
    for r in range(num_rows):
        chain, prev = [], int(ctx[r])
        for _ in range(int(res.num_accepted[r]) + 1):
            prev = int(target[prev].argmax())
            chain.append(prev)
        assert res.output_token_ids[r, :len(chain)].tolist() == chain
