"""Sampled TriForce output follows the target distribution, and a wrong hand-off inside
TriForce is caught; seeded runs reproduce; request lifecycle (join, finish, abort) leaks no
per-request state."""

import collections

import pytest

import tiny_models
from engine_helpers import (assert_drafted, drafter_of, force_depths, free_llm, in_process_llm,
                            make_engine_kwargs, watch_hand_off)
from test_triforce_engine import three_level, two_level
from vllm_triforce.tools.bench.gpu_summary import ALPHA, homogeneity_pvalue

pytestmark = pytest.mark.engine

NUM_SAMPLES = 2000
PROMPT_WORDS = 220  # 391 tokens of tiny_llama
# A retrieval budget of 9 of the prompt's 13 blocks: vLLM accepts about half of the
# middle level's drafts, so the distribution rests on accepted drafts and recovered tokens
# alike. (At 160 tokens it accepted 3%: almost every token was recovered from
# max(p - q, 0), nearly p whatever q was handed, and the wrong hand-off below passed.)
RETRIEVAL_BUDGET = 288
# Engine seeds (vLLM's sampler and the proposer's generator): a different one per engine,
# so the TriForce samples are not drawn from the same random stream as the reference's.
PLAIN_SEED, TRIFORCE_SEED, CORRUPTED_SEED = 0, 1, 2
# Every engine runs at most this many requests at once: every one drafts at the depth its
# schedule asks for (the drafting cap is max_num_seqs), and the steps stay small enough on
# CPU for NUM_SAMPLES continuations.
MAX_NUM_SEQS = 32
# Depths the depth controller uses in turn, 0 included: a draft length chosen without
# looking at its verification keeps sampling exact.
SCHEDULE = [3, 0, 2, 1]
# The negative control hands vLLM the middle level's distributions at this temperature
# instead of the ones its drafts were sampled from (see `forcing.hand_off_wrong`).
WRONG_TEMPERATURE = 0.5


def _samples(model, spec, seed, schedule=None):
    """NUM_SAMPLES continuations of one prompt (longer than the retrieval budget) at
    temperature 1, and the TriForce counters (None without TriForce) with `watch_hand_off`'s
    counts (`hand_off`): every verification read the probabilities handed for its request.
    `schedule`: depths the depth controller must use in turn (engine_helpers.force_depths)."""
    from vllm import SamplingParams

    llm = in_process_llm(model, spec,
                         **make_engine_kwargs(seed=seed, max_num_seqs=MAX_NUM_SEQS))
    if schedule is not None:
        force_depths(llm, schedule)
    hand_off_seen = watch_hand_off(llm) if spec else None
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    prompt = tiny_models.make_text(PROMPT_WORDS, seed=7)
    try:
        outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
        stats = dict(drafter_of(llm).stats.snapshot(), hand_off=hand_off_seen) if spec else None
    finally:
        free_llm(llm)
    return [tuple(o.outputs[0].token_ids) for o in outs], stats


def _pvalues(reference, samples) -> dict[int, float]:
    """Per drafted position (tokens 2..4; token 1 comes from the prefill): the p-value of
    the two samples having one distribution."""
    return {position: homogeneity_pvalue(collections.Counter(s[position] for s in reference),
                                         collections.Counter(s[position] for s in samples))
            for position in (1, 2, 3)}


def _triforce_spec() -> dict:
    return two_level(adaptive=True, retrieval_budget=RETRIEVAL_BUDGET)


def _assert_ran_the_schedule(stats) -> None:
    assert_drafted(stats)
    print(f"full-cache acceptance {stats['top_accepted']}/{stats['top_proposed']}; hand-off "
          f"{stats['hand_off']}")
    used = {k for k, n in enumerate(stats["depth_counts"]) if n}
    assert used == set(SCHEDULE), f"depths {stats['depth_counts']}, forced {SCHEDULE}"
    # depth-0 requests sit between drafting ones: the compact rows differ from batch rows
    assert stats["hand_off"]["checked"] > 0 and stats["hand_off"]["moved"] > 0


@pytest.fixture(scope="module")
def plain_samples(tiny_llama):
    return _samples(tiny_llama, None, PLAIN_SEED)[0]


@pytest.fixture(scope="module")
def triforce_samples(tiny_llama):
    """The depth controller on, its depths forced to vary per request and per step."""
    samples, stats = _samples(tiny_llama, _triforce_spec(), TRIFORCE_SEED, SCHEDULE)
    _assert_ran_the_schedule(stats)
    return samples


@pytest.mark.parametrize("position", [1, 2, 3])
def test_sampled_tokens_follow_target_distribution(plain_samples, triforce_samples, position):
    """Tokens 2..4 come from TriForce drafts (level 2, then vLLM's verification)."""
    p = _pvalues(plain_samples, triforce_samples)[position]
    print(f"token {position + 1}: p = {p:.3g}")
    assert p > ALPHA, f"token {position + 1}: TriForce distribution differs (p={p:.2e})"


def test_distribution_test_catches_a_wrong_hand_off(tiny_llama, plain_samples, monkeypatch):
    """Negative control through TriForce: the same engine and schedule, only the hand-off's
    probs wrong (see `forcing.hand_off_wrong`). The distribution test must reject it at ALPHA."""
    from vllm_triforce.engine import drafting
    from vllm_triforce.tools.bench.forcing import hand_off_wrong

    monkeypatch.setattr(drafting, "hand_off",
                        hand_off_wrong(drafting.hand_off, WRONG_TEMPERATURE))
    samples, stats = _samples(tiny_llama, _triforce_spec(), CORRUPTED_SEED, SCHEDULE)
    _assert_ran_the_schedule(stats)
    pvalues = _pvalues(plain_samples, samples)
    print("wrong hand-off: " + ", ".join(f"token {k + 1}: p = {p:.3g}"
                                         for k, p in pvalues.items()))
    assert min(pvalues.values()) < ALPHA, f"a wrong hand-off passed the test: {pvalues}"


def test_seeded_triforce_is_reproducible(tiny_llama):
    from vllm import SamplingParams

    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate((30, 200, 90))]
    runs = []
    for batch in (prompts, prompts[::-1]):  # another batch order: per-request seeds decide
        llm = in_process_llm(tiny_llama, two_level(), **make_engine_kwargs())
        params = [SamplingParams(temperature=0.9, seed=100 + prompts.index(p), max_tokens=24,
                                 ignore_eos=True) for p in batch]
        try:
            outs = llm.generate(batch, params, use_tqdm=False)
            assert_drafted(drafter_of(llm).stats.snapshot())  # seeds reach the middle level
        finally:
            free_llm(llm)
        runs.append({o.prompt: list(o.outputs[0].token_ids) for o in outs})
    assert runs[0] == runs[1]


def test_compiled_sampling_draws_the_eager_tokens(tiny_llama, tiny_draft):
    """`compiled_sampling` (core/compiled_sampling.py) draws what the eager path draws: three
    levels, seeded requests (the same uniforms either way), one batch filtering nothing
    and one with top-k and top-p, a greedy request in each; drafts verified, and every
    compiled function called. Its values differ from eager torch's in the last bits at
    most (tests/core/test_core_compiled_sampling.py), too little to move a draw here."""
    from vllm import SamplingParams

    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate((220, 60, 150, 90))]

    def params(filtered: bool) -> list:
        out = [SamplingParams(temperature=0.9, seed=200 + i, max_tokens=24, ignore_eos=True,
                              top_k=20 if filtered and i == 1 else 0,
                              top_p=0.8 if filtered and i == 2 else 1.0)
               for i in range(len(prompts) - 1)]
        return out + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]

    runs = []
    for compiled in (False, True):
        spec = three_level(tiny_draft, compiled_sampling=compiled)
        llm = in_process_llm(tiny_llama, spec, **make_engine_kwargs())
        try:
            tokens = [[list(o.outputs[0].token_ids)
                       for o in llm.generate(prompts, params(filtered), use_tqdm=False)]
                      for filtered in (False, True)]
            drafter = drafter_of(llm)
            assert_drafted(drafter.stats.snapshot())
            sampling = drafter.middle.sampling
            if compiled:
                assert sampling is not None and sampling.compiled, "compiled_sampling is off"
                calls = sampling.calls
                print(f"compiled calls {calls}")
                assert all(calls[name] > 0 for name in ("draw", "draw_filtered", "verify",
                                                        "verify_filtered")), calls
            else:
                assert sampling is None
        finally:
            free_llm(llm)
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_abort_and_finish_free_request_state(tiny_llama):
    """Requests join, finish and are aborted mid-generation; nothing stays behind."""
    from vllm import SamplingParams

    llm = in_process_llm(tiny_llama, two_level(), **make_engine_kwargs())
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
