"""Sampled TriForce output follows the target distribution; seeded runs reproduce; request
lifecycle (join, finish, abort) leaks no per-request state."""

import collections

import pytest

import tiny_models
from engine_helpers import free_llm, make_engine_kwargs
from test_triforce_engine import drafter_of, two_level

pytestmark = pytest.mark.engine

NUM_SAMPLES = 400
ALPHA = 1e-3  # fixed seeds: the outcome is deterministic; ALPHA only sets the bar


def _samples(model, spec, temperature, seed=0, schedule=None):
    """NUM_SAMPLES continuations of one prompt (longer than the retrieval budget).
    `schedule`: depths the depth controller must use in turn (its test hook)."""
    from vllm import LLM, SamplingParams

    llm = LLM(str(model), speculative_config=spec, **make_engine_kwargs(seed=seed))
    if schedule is not None:
        drafter_of(llm).depth.controller.forced = schedule
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    prompt = tiny_models.make_text(220, seed=7)
    try:
        outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    finally:
        free_llm(llm)
    return [tuple(o.outputs[0].token_ids) for o in outs]


def _homogeneity_pvalue(a, b) -> float:
    """Two-sample chi-square on token counts, rare tokens pooled (expected >= 5)."""
    from scipy.stats import chi2_contingency

    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    rows, other = [], [0, 0]
    for k in keys:
        if ca[k] + cb[k] >= 10:
            rows.append([ca[k], cb[k]])
        else:
            other[0] += ca[k]
            other[1] += cb[k]
    if sum(other) > 0:
        rows.append(other)
    return chi2_contingency(rows)[1]


@pytest.fixture(scope="module")
def plain_samples(tiny_llama):
    return _samples(tiny_llama, None, 1.0)


@pytest.mark.parametrize("position", [1, 2, 3])
def test_sampled_tokens_follow_target_distribution(tiny_llama, plain_samples, triforce_samples,
                                                   position):
    """Tokens 2..4 come from TriForce drafts (level 2, then vLLM's verification)."""
    p = _homogeneity_pvalue([s[position] for s in plain_samples],
                            [s[position] for s in triforce_samples])
    assert p > ALPHA, f"token {position + 1}: TriForce distribution differs (p={p:.2e})"


def test_distribution_test_can_fail(tiny_llama, plain_samples):
    """The same test on a different distribution (T=0.7) must reject: the test has power."""
    cooler = _samples(tiny_llama, None, 0.7)
    p = min(_homogeneity_pvalue([s[i] for s in plain_samples], [s[i] for s in cooler])
            for i in (1, 2, 3))
    assert p < ALPHA


@pytest.fixture(scope="module")
def triforce_samples(tiny_llama):
    """The depth controller on, its depths varying per request and per step (0 included):
    a draft length chosen without looking at its verification keeps sampling exact."""
    return _samples(tiny_llama, two_level(adaptive=True), 1.0, schedule=[3, 0, 2, 1])


def test_seeded_triforce_is_reproducible(tiny_llama):
    from vllm import LLM, SamplingParams

    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate((30, 200, 90))]
    runs = []
    for batch in (prompts, prompts[::-1]):  # another batch order: per-request seeds decide
        llm = LLM(str(tiny_llama), speculative_config=two_level(), **make_engine_kwargs())
        params = [SamplingParams(temperature=0.9, seed=100 + prompts.index(p), max_tokens=24,
                                 ignore_eos=True) for p in batch]
        try:
            outs = llm.generate(batch, params, use_tqdm=False)
        finally:
            free_llm(llm)
        runs.append({o.prompt: list(o.outputs[0].token_ids) for o in outs})
    assert runs[0] == runs[1]


def test_abort_and_finish_free_request_state(tiny_llama):
    """Requests join, finish and are aborted mid-generation; nothing stays behind."""
    from vllm import LLM, SamplingParams

    llm = LLM(str(tiny_llama), speculative_config=two_level(), **make_engine_kwargs())
    engine = llm.llm_engine
    try:
        greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa
        for i, n in enumerate((30, 200, 90, 150)):
            engine.add_request(f"r{i}", tiny_models.make_text(n, seed=i), greedy(20 + 10 * i))
        for _ in range(3):
            engine.step()
        engine.abort_request(["r1", "r3"])
        engine.add_request("late", tiny_models.make_text(60, seed=9), greedy(12))
        while engine.has_unfinished_requests():
            engine.step()
        drafter = drafter_of(llm)
        assert len(drafter.states) <= 3  # freed lazily: at most the last step's requests
        engine.add_request("last", tiny_models.make_text(20, seed=11), greedy(6))
        while engine.has_unfinished_requests():
            engine.step()
        assert set(r.split("-")[0] for r in drafter.states.states) <= {"last"}
    finally:
        free_llm(llm)
