"""TriForce with a KV connector (LMCache, NIXL's prefill/decode split, vLLM's
ExampleConnector here): a prompt's KV blocks arrive from outside, and no pass of this engine
computes their keys. TriForce's block summaries of those blocks come from the KV cache
itself (engine/summary_keeper.py: a full block without summaries is set from the cache
before a selection), so the engine selects the same blocks as one that computed the
prompts, and its output equals plain vLLM's with drafts verified.
"""

import pytest

import tiny_models
from engine_helpers import (assert_drafted, drafter_of, free_llm, in_process_llm,
                            make_engine_kwargs, record_selections)

pytestmark = pytest.mark.engine

PROMPT_WORDS = (300, 500, 700, 600)  # about 450 .. 1,050 tokens: all past the budget
SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 256,
        "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64, "refresh_interval": 1,
        "adaptive": False}


def connector(storage) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def generate(model, spec, kv_transfer_config=None):
    """Greedy tokens, each prompt's tokens that this engine did not compute (cached or
    loaded), and with `spec` the counters, every selection and whether summaries are set
    from the cache."""
    from vllm import SamplingParams

    kwargs = make_engine_kwargs(max_model_len=2048)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    llm = in_process_llm(model, spec, **kwargs)
    try:
        selections = record_selections(drafter_of(llm)) if spec else None
        prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48,
                                                       ignore_eos=True), use_tqdm=False)
        drafter = drafter_of(llm) if spec else None
        facts = None if drafter is None else (drafter.stats.snapshot(), selections,
                                              drafter.retrieval.keeper.lazy)
    finally:
        free_llm(llm)
    return ([list(o.outputs[0].token_ids) for o in outputs],
            [o.num_cached_tokens for o in outputs], facts)


def test_blocks_loaded_by_a_kv_connector_are_selected_as_if_computed(tiny_llama, tmp_path):
    plain, _, _ = generate(tiny_llama, None, connector(tmp_path))  # stores every prompt's KV
    computed, _, (_, computed_selections, _) = generate(tiny_llama, SPEC)
    loaded, not_computed, (stats, selections, from_cache) = generate(
        tiny_llama, SPEC, connector(tmp_path))
    assert all(n >= 32 for n in not_computed), f"no KV came from the connector: {not_computed}"
    assert computed == plain and loaded == plain
    assert_drafted(stats)
    if not from_cache:
        pytest.skip("this KV cache's layout has no reader (engine/paged_keys.py), so loaded "
                    "blocks have no summaries: outputs checked, selections not")
    assert selections == computed_selections
