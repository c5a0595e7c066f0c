"""`measure_middle_acceptance`: the retrieval cache's per-token acceptance sum_x min(p, q),
measured against the target over its full cache, leaves outputs unchanged and agrees with
vLLM's own verification."""

import pytest

from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs
from test_triforce_engine import MAX_TOKENS, greedy_params, plain, prompts, two_level

pytestmark = pytest.mark.engine


def _run(model, spec, params):
    llm = in_process_llm(model, spec, disable_log_stats=False, **make_engine_kwargs())
    try:
        outs = llm.generate(prompts(), params, use_tqdm=False)
        stats = drafter_of(llm).stats.snapshot()
        per_pos = next(m.values for m in llm.get_metrics()
                       if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos")
    finally:
        free_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outs], stats, per_pos


def test_greedy_measurement_matches_vllm_first_position(tiny_llama):
    """Greedy: p and q are one-hot, so sum min(p, q) at a request's first middle position is
    1 exactly when vLLM accepts that step's first draft. The measured sum must equal vLLM's
    accepted count at draft position 0, up to each request's last drafts, which vLLM never
    verifies because the request has finished."""
    spec = two_level("streamingllm", measure_middle_acceptance=True)
    tokens, stats, per_pos = _run(tiny_llama, spec, greedy_params())
    assert tokens == plain(tiny_llama)  # the extra full-cache pass changes nothing
    assert_drafted(stats)
    assert stats["middle_pq_count"] > 0
    measured = stats["middle_pq_sum"]
    assert measured == int(measured)  # one-hot distributions: whole numbers
    assert per_pos[0] <= measured <= per_pos[0] + len(MAX_TOKENS)
    assert measured < stats["middle_pq_count"]  # a 160-token budget does miss sometimes


def test_full_budget_measures_one_at_temperature_one(tiny_llama):
    """With every block selected the retrieval cache is the full cache: p == q."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    _, stats, _ = _run(tiny_llama, two_level(retrieval_budget=4096,
                                             measure_middle_acceptance=True), params)
    assert stats["middle_pq_count"] > 0
    assert stats["middle_pq_sum"] / stats["middle_pq_count"] > 1 - 1e-5
