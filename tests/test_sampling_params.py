"""vLLM's per-request sampling parameters through TriForce: penalties, logit bias, allowed and
bad words, min_tokens with stop tokens, logprobs, prompt logprobs, structured outputs and
n > 1, mixed in one batch. vLLM applies each of them to the target's logits when it verifies
(its rejection sampler) or to what it returns; TriForce's drafts only have to reach that
verification. Greedy requests must equal plain vLLM's token for token, with drafts verified,
for two and three levels.
"""

import pytest

import tiny_models
from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

PROMPT_WORDS = (30, 260, 520, 140)  # ~45 .. 800 tokens: three of four past the budget
STOP_TOKENS = [3, 9, 12, 21, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48]
LOGPROB_TOLERANCE = 1e-4  # float32: a verification pass against a decode step


def triforce_spec(draft=None) -> dict:
    """Two levels, fixed depth 4; with `draft`, three (the small draft proposing 2 a round)."""
    spec = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
            "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32,
            "refresh_interval": 16, "adaptive": False}
    if draft is not None:
        spec.update(model=str(draft), draft_window_tokens=96, draft_tokens_per_round=2)
    return spec


def batches() -> list[list]:
    """Two batches of four requests, one per prompt: each request's parameters differ."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    greedy = dict(temperature=0.0, max_tokens=40)
    person = {"type": "object", "required": ["name", "n"],
              "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    return [
        [SamplingParams(**greedy, repetition_penalty=1.3, ignore_eos=True),
         SamplingParams(**greedy, presence_penalty=0.8, frequency_penalty=0.6, logprobs=3,
                        ignore_eos=True),
         SamplingParams(**greedy, logit_bias={5: 3.0, 17: 2.0}, prompt_logprobs=2,
                        bad_words=["the", "a"], ignore_eos=True),
         SamplingParams(**greedy, min_tokens=30, stop_token_ids=STOP_TOKENS)],
        [SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
            regex="[a-z ]{10,200}")),
         SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json=person)),
         SamplingParams(**greedy, allowed_token_ids=list(range(50, 400))),
         SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=40, ignore_eos=True)],
    ]


def generate(model, spec):
    llm = in_process_llm(model, spec, disable_log_stats=spec is None, **make_engine_kwargs())
    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
    try:
        outputs = [llm.generate(prompts, params, use_tqdm=False) for params in batches()]
        stats = drafter_of(llm).stats.snapshot() if spec else None
    finally:
        free_llm(llm)
    return outputs, stats


@pytest.fixture(scope="module")
def plain_runs(tiny_llama):
    return generate(tiny_llama, None)[0]


@pytest.fixture(scope="module", params=[2, 3], ids=["two levels", "three levels"])
def runs(request, tiny_llama, tiny_draft, plain_runs):
    draft = tiny_draft if request.param == 3 else None
    triforce, stats = generate(tiny_llama, triforce_spec(draft))
    return plain_runs, triforce, (stats, request.param)


def test_greedy_requests_equal_plain_vllm_under_every_parameter(runs):
    plain, triforce, (stats, levels) = runs
    assert_drafted(stats, levels)
    for batch, params in enumerate(batches()):
        for request, (p, t, sp) in enumerate(zip(plain[batch], triforce[batch], params)):
            if sp.temperature > 0:
                continue
            where = f"batch {batch}, request {request} ({sp})"
            assert list(t.outputs[0].token_ids) == list(p.outputs[0].token_ids), where
            assert t.outputs[0].finish_reason == p.outputs[0].finish_reason, where


def test_min_tokens_and_stop_tokens_end_where_plain_vllm_ends(runs):
    plain, triforce, _ = runs
    ours, theirs = triforce[0][3].outputs[0], plain[0][3].outputs[0]
    assert theirs.finish_reason == "stop" and 30 <= len(theirs.token_ids) < 40, (
        "the case no longer stops early: choose other stop tokens")
    assert (ours.finish_reason, len(ours.token_ids)) == ("stop", len(theirs.token_ids))


def test_logprobs_and_prompt_logprobs_match_plain_vllm(runs):
    plain, triforce, _ = runs
    ours, theirs = triforce[0][1].outputs[0], plain[0][1].outputs[0]
    assert len(ours.logprobs) == len(theirs.logprobs) == 40
    for step, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
        assert set(a) == set(b), f"step {step}: top tokens {sorted(a)} against {sorted(b)}"
        for token in b:
            assert abs(a[token].logprob - b[token].logprob) < LOGPROB_TOLERANCE, (step, token)
    ours, theirs = triforce[0][2], plain[0][2]
    assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs) > 100
    for a, b, token in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:],
                           theirs.prompt_token_ids[1:]):
        assert abs(a[token].logprob - b[token].logprob) < LOGPROB_TOLERANCE


def test_structured_outputs_keep_their_grammar(runs):
    _, triforce, _ = runs
    text = triforce[1][0].outputs[0].text
    assert text and set(text) <= set("abcdefghijklmnopqrstuvwxyz "), repr(text)
    assert triforce[1][1].outputs[0].text.lstrip().startswith("{"), triforce[1][1].outputs[0].text


def test_n_samples_a_request_twice(runs):
    _, triforce, _ = runs
    samples = triforce[1][3].outputs
    assert [len(s.token_ids) for s in samples] == [40, 40]
    assert samples[0].token_ids != samples[1].token_ids
