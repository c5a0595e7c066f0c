"""core/compiled_sampling.py: its functions, run eagerly, give core/verify.py's eager
path bit for bit; compiled once, they give the same tokens for sizes never seen (no
recompilation), filtered or not, greedy rows among sampled ones."""

import types

import pytest
import torch

from vllm_triforce.core import compiled_sampling as cs
from vllm_triforce.core.verify import (draw_uniforms, sample_drawn, sampling_probs, verify)

VOCAB = 257


def _batch(num_reqs: int, filtered: bool, seed: int):
    """A StepBatch's sampling fields: a third of the rows greedy (temperature 0)."""
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(num_reqs, generator=gen) + 0.3
    temperature[torch.arange(num_reqs) % 3 == 1] = 0.0
    top_k = top_p = None
    if filtered:
        top_k = torch.randint(0, 40, (num_reqs,), generator=gen)
        top_p = torch.rand(num_reqs, generator=gen) * 0.6 + 0.4
    return types.SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p)


def _chunk(n: int, gamma: int, seed: int):
    """A middle chunk of n requests proposing up to gamma tokens (the first exactly gamma):
    its pass rows' owner (offset: the chunk's first request is the round's 4th) and slot,
    the proposals and their distributions, the per-request sizes."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, gamma + 1, (n,), generator=gen)
    sizes[0] = gamma
    inputs = sizes + 1
    first = torch.cumsum(inputs, 0) - inputs
    owner = torch.repeat_interleave(torch.arange(n), inputs)
    slot = torch.arange(int(inputs.sum())) - first[owner]
    q = torch.softmax(torch.randn(n, gamma, VOCAB, generator=gen) * 3, -1)
    ids = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(n, gamma)
    return owner + 3, slot, ids, q, sizes


def _draw_eagerly(logits, rows, batch, uniform):
    """Today's eager path: `StepBatch.probs` then `sample_tokens`'s draw."""
    def per_token(values):
        return None if values is None else values[rows]
    probs = sampling_probs(logits, per_token(batch.temperature), per_token(batch.top_k),
                           per_token(batch.top_p), all_greedy=False)
    return probs, sample_drawn(probs, batch.temperature[rows] < 1e-5, uniform)


def _verify_eagerly(logits, req_rows, batch, owner, slot, ids, q, sizes, seeds):
    """Today's eager middle chunk: probabilities, `_RoundLayout.per_request`, `verify`
    with a seeded generator per row."""
    owner = owner - owner[0]
    probs, _ = _draw_eagerly(logits, req_rows[owner], batch,
                             torch.zeros(logits.shape[0], dtype=torch.float64))
    p = probs.new_zeros(ids.shape[0], ids.shape[1] + 1, VOCAB)
    p[owner, slot] = probs
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    result = verify(ids, q, p, sizes, batch.temperature[req_rows] < 1e-5, generators)
    return result.output_token_ids, result.num_accepted, p


def _args(filtered: bool, batch):
    top_k, top_p = cs._filters(batch)
    return (batch.temperature, top_k, top_p) if filtered else (batch.temperature,)


@pytest.mark.parametrize("filtered", [False, True])
def test_the_eager_twin_is_the_eager_path(filtered):
    batch = _batch(9, filtered, seed=1)
    rows = torch.tensor([4, 1, 7, 0, 2])
    logits = torch.randn(5, VOCAB) * 4
    uniform = torch.rand(5, dtype=torch.float64)
    name = "draw_filtered" if filtered else "draw"
    probs, tokens = cs.EAGER[name](logits, rows, *_args(filtered, batch), uniform)
    want_probs, want_tokens = _draw_eagerly(logits, rows, batch, uniform)
    assert torch.equal(probs, want_probs) and torch.equal(tokens, want_tokens)

    owner, slot, ids, q, sizes = _chunk(4, 3, seed=2)
    logits = torch.randn(owner.shape[0], VOCAB) * 4
    req_rows, seeds = torch.tensor([8, 1, 3, 5]), [11, 12, 13, 14]
    uniform = draw_uniforms(4, 4, [torch.Generator().manual_seed(s) for s in seeds], "cpu")
    name = "verify_filtered" if filtered else "verify"
    got = cs.EAGER[name](logits, req_rows, *_args(filtered, batch), owner, slot, ids, q, sizes,
                         uniform)
    want = _verify_eagerly(logits, req_rows, batch, owner, slot, ids, q, sizes, seeds)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def sampling():
    """Compiled with the tests' one thread (conftest.py): inductor's CPU code guards on the
    thread count, and a call under another would recompile."""
    compiled, before = cs.CompiledSampling(torch.float32), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = compiled.warm_up(VOCAB, "cpu")
    finally:
        torch.set_num_threads(before)
    print(f"compiled in {seconds:.1f} s")
    return compiled


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("n, gamma", [(1, 1), (2, 4), (7, 3), (40, 6)])
def test_compiled_gives_the_eager_tokens_for_sizes_never_seen(sampling, filtered, n, gamma):
    batch = _batch(n + 5, filtered, seed=n)
    with torch.inference_mode():
        rows = torch.randperm(n + 5)[:n]
        logits = torch.randn(n, VOCAB) * 4
        uniform = torch.rand(n, dtype=torch.float64)
        probs, tokens = sampling.draw(logits, rows, batch, uniform)
        want_probs, want_tokens = _draw_eagerly(logits, rows, batch, uniform)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
        assert torch.equal(tokens, want_tokens)

        owner, slot, ids, q, sizes = _chunk(n, gamma, seed=n + gamma)
        logits = torch.randn(owner.shape[0], VOCAB) * 4
        seeds = list(range(100, 100 + n))
        uniform = draw_uniforms(n, gamma + 1, [torch.Generator().manual_seed(s) for s in seeds],
                                "cpu")
        out, accepted, p = sampling.verify(logits, rows, batch, owner, slot, ids, q, sizes,
                                           uniform)
        want_out, want_accepted, want_p = _verify_eagerly(logits, rows, batch, owner, slot,
                                                          ids, q, sizes, seeds)
    torch.testing.assert_close(p, want_p, rtol=1e-5, atol=1e-7)
    assert torch.equal(out, want_out) and torch.equal(accepted, want_accepted)
    assert sampling.compiled, "a compiled call failed and fell back to eager"


def test_a_failed_compiled_call_falls_back_to_eager_with_a_warning(caplog):
    compiled = cs.CompiledSampling(torch.float32)

    def broken(*args):
        raise RuntimeError("would recompile")

    compiled._compiled = dict.fromkeys(cs.EAGER, broken)
    batch = _batch(3, False, seed=5)
    rows, logits = torch.tensor([0, 2]), torch.randn(2, VOCAB)
    uniform = torch.rand(2, dtype=torch.float64)
    probs, tokens = compiled.draw(logits, rows, batch, uniform)
    assert torch.equal(tokens, _draw_eagerly(logits, rows, batch, uniform)[1])
    assert not compiled.compiled and "compiled draw failed" in caplog.text
    assert compiled.calls["draw"] == 1
