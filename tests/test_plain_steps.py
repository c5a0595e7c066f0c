"""engine/plain_steps.py: steps with nothing to do are found on the host, and cost nothing.

A step in which no request can draft (every context fits the retrieval budget, nothing was
handed last step, no key must be folded) returns vLLM its empty drafts before reading any
device value: no sync (on a CPU every read of a tensor counts as one,
tools/bench/syncs.py), no batch, no TriForce work. Requests that outgrow the budget
later still draft, and every output stays plain vLLM's.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_triforce.engine.batch import of_rows
from vllm_triforce.engine.plain_steps import never_drafts

SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
        "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32}


def request(prompt: int, max_tokens, min_p: float = 0.0):
    params = SimpleNamespace(max_tokens=max_tokens, min_p=min_p, logit_bias=None)
    return SimpleNamespace(num_prompt_tokens=prompt, sampling_params=params)


def test_never_drafts_when_its_longest_context_fits_or_it_samples_plainly():
    # blocks of 32, a 4,096-token budget (128 blocks): the docstring's example
    assert never_drafts(request(1500, 48), 32, 128)
    assert not never_drafts(request(1500, 4000), 32, 128)
    assert never_drafts(request(4000, 96), 32, 128)  # 4,096 tokens: 128 blocks, fits
    assert not never_drafts(request(4000, 97), 32, 128)
    assert not never_drafts(request(100, None), 32, 128)  # no bound on its length
    assert never_drafts(request(9000, 4000, min_p=0.1), 32, 128)  # vLLM's plain sampler


def _generate(llm, prompts, max_tokens: int):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(n: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [(11 * i + 5 * j) % 250 + 1 for j in range(length)]}
            for i in range(n)]


@pytest.mark.engine
def test_a_job_inside_the_budget_does_no_triforce_work_and_no_sync(tiny_llama, llm_factory):
    from engine_helpers import drafter_of
    from vllm_triforce.tools.bench.syncs import ProposeSyncs, summarise

    prompts = _prompts(3, 60)  # 60 + 12 tokens: 3 blocks of 32, the budget holds 5
    plain = _generate(llm_factory(tiny_llama), prompts, 12)
    llm = llm_factory(tiny_llama, speculative_config=dict(SPEC))
    drafter = drafter_of(llm)
    capture, layers, proposed = drafter.layer_capture, [], []
    record, propose = capture.record, drafter.propose
    capture.record = lambda index, *args: (layers.append(index), record(index, *args))[1]
    drafter.propose = lambda *args, **kwargs: (proposed.append(1), propose(*args, **kwargs))[1]
    with ProposeSyncs(drafter) as recorder:
        recorder.take()
        tokens = _generate(llm, prompts, 12)
        syncs = summarise(recorder.take())
    stats = drafter.stats.snapshot()
    assert tokens == plain
    # every pass was asked at its first layer whether it is read, and none was recorded;
    # every step was done before vLLM prepared the drafter's inputs (plain_propose)
    assert layers and set(layers) == {0} and capture.unread, layers
    assert all(q is None for q in capture.queries)
    assert not proposed
    assert stats["host_plain_steps"] >= 12 and stats["drafting_steps"] == 0, stats
    assert stats["host_plain_steps"] == syncs["num_steps"], (stats, syncs)
    assert syncs["max_step"] == 0 and syncs["once"] == 0, syncs["by_op"]
    assert len(drafter.states) == 0  # no request state was ever made
    assert drafter.retrieval.keeper.status == "not checked yet"  # nor the reader checked


@pytest.mark.engine
def test_requests_that_outgrow_the_budget_draft_after_host_plain_steps(tiny_llama,
                                                                        llm_factory):
    """Prompts of 100 tokens that grow to 220 (the budget holds 160): plain steps on the
    host while they fit, then drafting; the tokens are plain vLLM's and drafts were
    verified."""
    from engine_helpers import assert_drafted, drafter_of, force_depths

    prompts = _prompts(2, 100)
    plain = _generate(llm_factory(tiny_llama), prompts, 120)
    llm = llm_factory(tiny_llama, speculative_config=dict(SPEC))
    force_depths(llm, [4, 2, 3])  # the controller's path, its budget rule still applies
    answers = _compare_plans(drafter_of(llm))
    tokens = _generate(llm, prompts, 120)
    stats = drafter_of(llm).stats.snapshot()
    assert_drafted(stats)
    assert stats["host_plain_steps"] > 0, stats
    assert tokens == plain
    assert set(answers) == {True, False}, answers  # plain steps, then working ones


@pytest.mark.engine
def test_a_step_the_controller_keeps_plain_is_a_host_plain_step(tiny_llama, llm_factory):
    """Prompts past the budget from the start (200 tokens, the budget holds 160), the
    controller planning [4, 0, 0, 0] in turn (request i of plan n: entry n + i): a plan
    of [0, 0] after a step that handed no drafts is made during vLLM's pass
    (`PlainSteps.plan_ahead`) and its step is a host plain step: no sync, the pass not
    recorded, no batch. Tokens are plain vLLM's, drafts were verified, and without the
    plan made ahead the same schedule runs no host plain step."""
    from engine_helpers import assert_drafted, drafter_of, force_depths
    from vllm_triforce.engine.batch import StepBatch
    from vllm_triforce.tools.bench.syncs import ProposeSyncs

    prompts = _prompts(2, 200)
    plain = _generate(llm_factory(tiny_llama), prompts, 40)
    for ahead in (True, False):
        llm = llm_factory(tiny_llama, speculative_config=dict(SPEC))
        drafter = drafter_of(llm)
        drafter.plan_ahead = ahead
        force_depths(llm, [4, 0, 0, 0])
        batches, from_runner = [], StepBatch.from_runner
        StepBatch.from_runner = lambda *a, **k: batches.append(1) or from_runner(*a, **k)
        try:
            with ProposeSyncs(drafter) as recorder:
                recorder.take()
                tokens = _generate(llm, prompts, 40)
                steps = recorder.take()
        finally:
            StepBatch.from_runner = from_runner
        stats = drafter.stats.snapshot()
        assert tokens == plain
        assert_drafted(stats)
        if not ahead:
            assert stats["host_plain_steps"] == 0, stats
            continue
        # plans n = 2, 6, 10, ...: a quarter of the decode steps, less the start
        assert stats["host_plain_steps"] >= 6, stats
        silent = sum(1 for c in steps if not any(c.counts.values()))
        assert silent >= stats["host_plain_steps"], (silent, stats)
        assert len(batches) == len(steps) - stats["host_plain_steps"], (len(batches), stats)


def _compare_plans(drafter) -> list[bool]:
    """Wraps `drafter.propose`, which then takes every step (plain ones too: no
    `propose_plain_step`): each step, the plan made during vLLM's pass (`read_v1_ahead`'s
    facts and whether the step is plain) must equal what `read_v1` reads after the pass;
    returns the answers as the steps go."""
    from vllm_triforce.engine.plain_steps import PlainSteps

    propose, answers = drafter.propose, []
    drafter.propose_plain_step = lambda: None  # every step through `propose`, compared

    def compared(*args, **kwargs):
        facts, plain = drafter._pass_plan
        after = PlainSteps.read_v1(drafter.runner, kwargs["common_attn_metadata"])
        assert facts.req_ids == after.req_ids
        for name in ("query_start_loc", "seq_lens", "decoding"):
            assert (getattr(facts, name) == getattr(after, name)).all(), name
        # the same answer, or a step the controller kept plain during the pass (its plan
        # made ahead, taken by this step)
        assert plain == drafter.plain_steps.is_plain(after, drafter.runner.requests,
                                                     drafter._handed_last) or (
            plain and drafter.depth.planned_ahead)
        answers.append(plain)
        return propose(*args, **kwargs)

    drafter.propose = compared
    return answers


def test_plain_propose_returns_a_plain_steps_drafts_before_vllms_preparation():
    """patches/plain_propose.py on a stand-in runner: a drafter that took the step as
    plain answers with its drafts, vLLM's call never runs and no probabilities are kept;
    a drafter that did not (None), or async scheduling, leaves vLLM's call as it is."""
    from vllm_triforce.patches.plain_propose import _make_propose_draft_token_ids

    calls = []
    wrapped = _make_propose_draft_token_ids(lambda runner, *args: calls.append(args) or "vllm")
    for answer, async_scheduling, want in (([[], []], False, [[], []]), (None, False, "vllm"),
                                           ([[]], True, "vllm")):
        calls.clear()
        runner = SimpleNamespace(drafter=SimpleNamespace(propose_plain_step=lambda: answer),
                                 use_async_scheduling=async_scheduling,
                                 _draft_probs="stale", _draft_prob_req_ids=["stale"])
        assert wrapped(runner, "scheduler output") == want
        assert (calls == []) == (want != "vllm")
        if want != "vllm":
            assert runner._draft_probs is None and runner._draft_prob_req_ids is None
    calls.clear()  # another drafter (vLLM's own): untouched
    assert wrapped(SimpleNamespace(drafter=object(), use_async_scheduling=False), 1) == "vllm"
    assert calls == [(1,)]


def test_of_rows_takes_the_rows_values_and_all_of_them_as_they_are():
    ids = ["a", "b", "c"]
    assert of_rows(ids, np.array([0, 2])) == ["a", "c"]
    assert of_rows(ids, [1]) == ["b"]
    assert of_rows(ids, np.array([], dtype=np.int64)) == []
    assert of_rows(ids, np.arange(3)) is ids  # every request decodes: no copy
