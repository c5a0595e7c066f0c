"""The depth rules inside vLLM, with the real (clock-driven) controller on:

- a request whose context fits the retrieval budget never drafts (the middle
  level would be the target), one that outgrows it does;
- a seeded sampled request's text is a function of its prompt, parameters and
  seed: the same alone, in a batch, again on the same engine, and on a new engine;
- requests with `min_p` or `logit_bias` (refused by vLLM's own speculative
  decoding) are served at depth 0 with plain vLLM's exact tokens, beside drafting ones.

Budget 160 tokens = 5 blocks of 32 (core/controller.middle_level_is_the_target).
"""

import pytest

import tiny_models
from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

BUDGET_TOKENS = 160


def spec(**extra):
    return {"method": "triforce", "num_speculative_tokens": 4,
            "retrieval_budget": BUDGET_TOKENS, "retrieval_sink_tokens": 16,
            "retrieval_recent_tokens": 32, **extra}  # adaptive: the default, on


def prompt_of(llm, num_tokens: int, seed: int):
    """A prompt of exactly `num_tokens` tokens."""
    from vllm.inputs import TokensPrompt

    ids = llm.get_tokenizer()(tiny_models.make_text(num_tokens, seed=seed))["input_ids"]
    assert len(ids) >= num_tokens
    return TokensPrompt(prompt_token_ids=ids[:num_tokens])


def record_plans(llm) -> list[tuple[int, int, bool]]:
    """Wrap the engine's DepthChooser.plan: every (committed tokens, depth, must decode
    plainly) it decided."""
    depth = drafter_of(llm).depth
    seen, plan = [], depth.plan

    def planning(step, req_ids, max_depth, num_committed=None, seeded=None, plain=None):
        depths, use_draft = plan(step, req_ids, max_depth, num_committed, seeded, plain)
        seen.extend(zip(num_committed, depths, plain or [False] * len(depths)))
        return depths, use_draft

    depth.plan = planning
    return seen


def stats_of(llm) -> dict:
    return drafter_of(llm).stats.snapshot()


def since(before: dict, after: dict) -> dict:
    """Counters of the run between two snapshots (the depth histogram grows as it goes)."""
    def minus(a, b):
        if isinstance(a, list):
            return [x - y for x, y in zip(a, b + [0] * (len(a) - len(b)))]
        return a - b

    return {k: minus(after[k], before[k]) for k in ("top_proposed", "middle_proposed",
                                                     "drafting_steps", "middle_rounds",
                                                     "depth_counts")}


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_request_whose_context_fits_the_budget_never_drafts(tiny_llama):
    llm = in_process_llm(tiny_llama, spec(), **make_engine_kwargs())
    try:
        plans = record_plans(llm)
        fits = prompt_of(llm, 60, seed=1)       # 60 + 40 tokens <= 160
        outgrows = prompt_of(llm, 140, seed=2)  # 140 + 80 tokens > 160

        before = stats_of(llm)
        llm.generate([fits], greedy(40), use_tqdm=False)
        alone = since(before, stats_of(llm))
        assert alone["top_proposed"] == alone["drafting_steps"] == alone["middle_rounds"] == 0
        assert sum(alone["depth_counts"][1:]) == 0 and alone["depth_counts"][0] >= 39

        before = stats_of(llm)
        llm.generate([fits, outgrows], [greedy(40), greedy(80)], use_tqdm=False)
        both = since(before, stats_of(llm))
        assert_drafted(both)  # the one that outgrew the budget drafted
        assert both["drafting_steps"] > 0
        for num_committed, depth, _ in plans:
            if num_committed <= BUDGET_TOKENS:
                assert depth == 0, f"drafted {depth} at {num_committed} committed tokens"
        assert any(depth > 0 for n, depth, _ in plans if n > BUDGET_TOKENS)
    finally:
        free_llm(llm)


SEEDED_PROMPT_TOKENS = 300  # outgrows the budget from the start: the request drafts
OTHERS = ((60, 24), (250, 40), (420, 32))  # unseeded: (prompt tokens, new tokens)


def seeded_runs(llm) -> list[tuple[list[int], dict]]:
    """The seeded request alone, inside a batch of unseeded sampled ones, alone again:
    (its token ids, the counters of that run) each."""
    from vllm import SamplingParams

    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=48,
                            ignore_eos=True)
    prompt = prompt_of(llm, SEEDED_PROMPT_TOKENS, seed=7)
    others = [prompt_of(llm, n, seed=20 + i) for i, (n, _) in enumerate(OTHERS)]
    unseeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, ignore_eos=True)
                for _, m in OTHERS]
    runs = []
    for batch, params in (([prompt], [seeded]),
                          ([others[0], prompt, *others[1:]], [unseeded[0], seeded, *unseeded[1:]]),
                          ([prompt], [seeded])):
        before = stats_of(llm)
        outs = llm.generate(batch, params, use_tqdm=False)
        tokens = next(list(o.outputs[0].token_ids) for o, p in zip(outs, params) if p is seeded)
        runs.append((tokens, since(before, stats_of(llm))))
    return runs


@pytest.mark.parametrize("levels", [2, 3])
def test_a_seeded_request_reads_the_same_alone_batched_again_and_on_a_new_engine(
        levels, tiny_llama, tiny_qwen2, tiny_draft):
    """Controller on (the default): the clocks, the other requests and the engine's history
    decide the unseeded requests' depths, never the seeded one's (engine/depth.py)."""
    model, extra = tiny_llama, {}
    if levels == 3:
        model, extra = tiny_qwen2, {"model": str(tiny_draft), "draft_window_tokens": 96,
                                    "draft_tokens_per_round": 2}
    texts = []
    for engine in range(2):
        llm = in_process_llm(model, spec(**extra), **make_engine_kwargs())
        try:
            runs = seeded_runs(llm) if engine == 0 else seeded_runs(llm)[:1]
        finally:
            free_llm(llm)
        for tokens, counters in runs:
            texts.append(tokens)
            assert_drafted(counters, levels)  # the seeded request drafted in every run
    alone, batched, again, new_engine = texts
    assert len(alone) == 48
    assert batched == alone, "another batch changed the seeded request's text"
    assert again == alone, "the engine's history changed the seeded request's text"
    assert new_engine == alone, "a new engine changed the seeded request's text"


def plain_rule_requests(llm, bias: dict):
    """Prompts that outgrow the budget (the controller would draft for them) and their
    params: min_p and logit_bias, greedy and seeded sampled, and two greedy requests
    without either (these draft)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, logit_bias=bias, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.05, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, logit_bias=bias, seed=12, max_tokens=40,
                       ignore_eos=True),
        greedy(60), greedy(60),
    ]
    prompts = [prompt_of(llm, n, seed=40 + i) for i, n in enumerate((220, 260, 300, 240, 280))]
    return prompts, params


def test_min_p_and_logit_bias_requests_get_plain_vllms_tokens_beside_drafting_ones(tiny_llama):
    llm = in_process_llm(tiny_llama, **make_engine_kwargs())
    try:
        prompts, _ = plain_rule_requests(llm, {})
        unbiased = list(llm.generate(prompts[:1], greedy(40), use_tqdm=False)[0]
                        .outputs[0].token_ids)
        bias = {t: -100.0 for t in list(dict.fromkeys(unbiased))[:3]}  # bans its first tokens
        prompts, params = plain_rule_requests(llm, bias)
        plain = [list(o.outputs[0].token_ids) for o in
                 llm.generate(prompts, params, use_tqdm=False)]
    finally:
        free_llm(llm)
    assert not set(bias) & set(plain[0]) and len(set(plain[0])) > 3

    llm = in_process_llm(tiny_llama, spec(), **make_engine_kwargs())
    try:
        seen = record_plans(llm)
        before = stats_of(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        counters = since(before, stats_of(llm))
    finally:
        free_llm(llm)
    triforce = [list(o.outputs[0].token_ids) for o in outs]
    assert_drafted(counters)  # the two requests without min_p / logit_bias drafted
    assert any(p for _, _, p in seen) and all(k == 0 for _, k, p in seen if p)
    assert triforce == plain
