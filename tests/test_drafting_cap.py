"""Every decoding request past the retrieval budget may draft in one step, up to
max_num_seqs (issue #51): the drafting cap is what the memory plan's share of the cache
holds, not a constant.

An engine of 72 sequences (more than one chunk of the middle round's vocabulary work,
engine/buffers.py `middle_chunk_requests`), every prompt past a 160-token budget, a fixed
depth: the proposer hands a draft to all 72 requests in one step (counted at the
proposer's output, the lists vLLM schedules), the hand-off buffer has a row for each, and
the greedy tokens are plain vLLM's.
"""

import pytest
import tiny_models
from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

NUM_REQUESTS = 72
SPEC = {"method": "triforce", "num_speculative_tokens": 3, "retrieval_budget": 160,
        "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32, "adaptive": False}


def count_drafting(drafter) -> list[tuple[int, int]]:
    """Wrap `propose`: per step, (requests handed a draft, requests in vLLM's batch)."""
    propose, seen = drafter.propose, []

    def counted(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        seen.append((sum(1 for d in drafts if d), len(drafts)))
        return drafts

    drafter.propose = counted
    return seen


def generate(model, spec):
    from vllm import SamplingParams

    llm = in_process_llm(model, spec,
                         **make_engine_kwargs(max_num_seqs=NUM_REQUESTS, max_model_len=512))
    prompts = [tiny_models.make_text(150, seed=i) for i in range(NUM_REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        if spec is None:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs], None
        drafter = drafter_of(llm)
        steps = count_drafting(drafter)
        outs = llm.generate(prompts, params, use_tqdm=False)
        facts = dict(steps=steps, stats=drafter.stats.snapshot(),
                     cap=drafter.depth.max_drafting, sizing=drafter.sizing,
                     buffer_rows=drafter._probs_buffer.rows.shape[0],
                     committed_past_budget=all(len(llm.get_tokenizer()(p).input_ids) > 160
                                               for p in prompts))
        return [list(o.outputs[0].token_ids) for o in outs], facts
    finally:
        free_llm(llm)


def test_every_request_past_the_budget_drafts_in_one_step_and_greedy_is_plain(tiny_llama):
    tokens, facts = generate(tiny_llama, dict(SPEC))
    assert facts["committed_past_budget"]  # every prompt outgrows the budget
    assert facts["cap"] == facts["sizing"].drafting == facts["buffer_rows"] == NUM_REQUESTS
    most = max(handed for handed, _ in facts["steps"])
    print(f"\ndrafting requests per step: {[h for h, _ in facts['steps']]}")
    assert (most, NUM_REQUESTS) in facts["steps"]  # all of them, in one step
    assert_drafted(facts["stats"])
    assert tokens == generate(tiny_llama, None)[0]
