"""engine/device/capture.py records nothing during vLLM's dummy and profile runs.

vLLM sizes the KV cache from the peak memory of its profile run (`profile_run`: one dummy
forward of max_num_batched_tokens tokens, vllm/v1/worker/gpu_model_runner.py, 0.32.0). A
capture that kept every layer's query and key of that forward would keep them alive and
inflate the measured peak. On CPU, vLLM runs the profile run at start-up only to warm up
compiled graphs (`CPUModelRunner.warming_up_model`), so one test starts a compiled engine
and the other replays the GPU worker's profile run on an eager one.
"""

import pytest

from engine_helpers import drafter_of, runner_of

pytestmark = pytest.mark.engine

SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
        "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32}


def assert_nothing_captured(llm) -> None:
    capture = drafter_of(llm).layer_capture
    assert all(q is None for q in capture.queries), "queries kept from a dummy run"
    assert all(k is None for k in capture.keys), "keys kept from a dummy run"


def test_start_up_warm_up_run_is_not_captured(tiny_llama, llm_factory):
    # Compiled (no enforce_eager): the CPU worker runs `profile_run` at start-up. The eager
    # dynamo backend keeps compilation cheap.
    llm = llm_factory(tiny_llama, speculative_config=dict(SPEC), enforce_eager=False,
                      compilation_config={"mode": "DYNAMO_TRACE_ONCE", "backend": "eager"})
    assert_nothing_captured(llm)


def test_profile_run_is_not_captured_but_real_steps_are(tiny_llama, llm_factory):
    """Nor is a plain step's pass (engine/plain_steps.py: this short request never
    drafts), whose queries and keys nobody reads; at a fixed depth every step is read,
    and every pass is captured."""
    from vllm import SamplingParams

    llm = llm_factory(tiny_llama, speculative_config=dict(SPEC))
    runner_of(llm).profile_run()  # what the GPU worker runs before sizing the KV cache
    assert_nothing_captured(llm)

    drafter = drafter_of(llm)
    captured_at_propose = []
    propose, plain_step = drafter.propose, drafter.propose_plain_step

    def captured() -> bool:
        return all(q is not None for q in drafter.layer_capture.queries)

    def recording_propose(*args, **kwargs):
        captured_at_propose.append(captured())
        return propose(*args, **kwargs)

    def recording_plain_step():  # a plain step, done before vLLM's `propose` call
        was = captured()
        drafts = plain_step()
        if drafts is not None:
            captured_at_propose.append(was)
        return drafts

    drafter.propose, drafter.propose_plain_step = recording_propose, recording_plain_step
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(["a b c d e f g h"], params, use_tqdm=False)
    assert captured_at_propose and not any(captured_at_propose)
    assert drafter.stats.snapshot()["host_plain_steps"] == len(captured_at_propose)
    captured_at_propose.clear()
    drafter.set_fixed_depth(2)
    llm.generate(["a b c d e f g i"], params, use_tqdm=False)
    assert captured_at_propose and all(captured_at_propose)


def _run_recording_selections(llm, prompts) -> dict:
    """Greedy tokens, every selection the retrieval level chose (logical blocks per layer)
    and TriForce's draft counts, of an engine at a fixed depth (`adaptive: false`)."""
    from vllm import SamplingParams

    from engine_helpers import assert_drafted, record_selections

    drafter = drafter_of(llm)
    selections = record_selections(drafter)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24),
                        use_tqdm=False)
    stats = drafter.stats.snapshot()
    assert_drafted(stats)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "selections": selections,
            "accepted": (stats["top_proposed"], stats["top_accepted"])}


@pytest.mark.parametrize("round_graphs", [False, True], ids=["clones", "buffers"])
def test_capture_survives_graph_pool_reuse(round_graphs, tiny_llama, llm_factory, monkeypatch):
    """Under PIECEWISE CUDA graphs, the query and key a layer's attention is handed live in
    the graph pool, which the next pieces overwrite before the proposer reads them. Here
    every pass a GPU may replay as a graph (at most capture.DEFAULT_COPY_TOKENS tokens:
    vLLM's CPU config sets no capture sizes) has its query and key overwritten right after
    each layer's attention: selections, acceptance and tokens must not change, whether the
    capture keeps clones or copies into its persistent buffers (`round_graphs`)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_triforce.engine.device.capture import DEFAULT_COPY_TOKENS

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(300 + 60 * i)]}
               for i in range(3)]
    spec = dict(SPEC, num_speculative_tokens=4, adaptive=False, round_graphs=round_graphs)
    clean = _run_recording_selections(llm_factory(tiny_llama, speculative_config=spec),
                                      prompts)

    forward = CPUAttentionBackendImpl.forward

    def reusing_pool(self, layer, query, key, *args, **kwargs):
        out = forward(self, layer, query, key, *args, **kwargs)
        if query.shape[0] <= DEFAULT_COPY_TOKENS:  # what a graph's next piece would do
            with torch.no_grad():
                query.normal_()
                if key is not None:
                    key.normal_()
        return out

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", reusing_pool)
    llm = llm_factory(tiny_llama, speculative_config=spec)
    overwritten = _run_recording_selections(llm, prompts)
    buffers = drafter_of(llm).layer_capture.step_buffers
    assert (buffers is not None and buffers.nbytes > 0) == round_graphs
    assert clean["selections"], "no selection was made: the test proves nothing"
    assert overwritten["selections"] == clean["selections"]
    assert overwritten["accepted"] == clean["accepted"]
    assert overwritten["tokens"] == clean["tokens"]


def test_a_large_pass_is_copied_where_references_may_not_hold():
    """`copy_large_passes`: a pass larger than copy_tokens keeps copies of its query and
    key (and a middle pass of its query), so what attention's inputs later hold (inductor
    reusing their buffers inside one compiled graph) leaves the kept values as they were;
    without it they are the pass's own tensors, which is what an eager model or vLLM's
    graph split at attention allows."""
    import torch

    from vllm_triforce.engine.device.capture import CaptureBuffers, LayerCapture

    for copy_large in (False, True):
        capture = LayerCapture(num_layers=2, copy_tokens=4, copy_large_passes=copy_large)
        query, key = torch.randn(9, 2, 4), torch.randn(9, 1, 4)
        want_q, want_k = query.clone(), key.clone()
        capture.record(1, query, key)
        with capture.recording(into=CaptureBuffers(2, max_tokens=4, keep_keys=False)):
            capture.record(0, query, key)  # a middle pass too large for its buffers
        middle_query = capture.queries[0]
        query.normal_(), key.normal_()  # a later operation writes into their memory
        assert (capture.queries[1] is query) == (not copy_large)
        assert (capture.keys[1] is key) == (not copy_large)
        assert (middle_query is query) == (not copy_large)
        if copy_large:
            assert torch.equal(capture.queries[1], want_q) and torch.equal(middle_query, want_q)
            assert torch.equal(capture.keys[1], want_k)


def test_references_hold_only_outside_one_compiled_graph():
    """Which vLLM compilations hand attention inputs that keep their values after the
    forward (capture.references_outlive_passes): eager models, dynamo's eager backends and
    vLLM's piecewise compilation split at attention do; vLLM's CPU compilation (one
    inductor graph: DYNAMO_TRACE_ONCE, vllm/platforms/cpu.py), an inductor graph partition
    or a split that leaves attention inside a piece do not."""
    from vllm.config import CompilationConfig, CompilationMode

    from vllm_triforce.engine.device.capture import references_outlive_passes

    def why(enforce_eager=False, **config):
        return references_outlive_passes(CompilationConfig(**config), enforce_eager)

    attention_ops = list(CompilationConfig()._attention_ops)
    assert why(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="inductor", enforce_eager=True) == ""
    assert why(mode=CompilationMode.NONE) == ""
    assert why(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager") == ""
    assert why(mode=CompilationMode.VLLM_COMPILE, splitting_ops=attention_ops,
               use_inductor_graph_partition=False) == ""
    assert "DYNAMO_TRACE_ONCE, backend inductor" in why(mode=CompilationMode.DYNAMO_TRACE_ONCE,
                                                        backend="inductor")
    assert why(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[],
               use_inductor_graph_partition=False)
    assert why(mode=CompilationMode.VLLM_COMPILE, splitting_ops=attention_ops,
               use_inductor_graph_partition=True)


def test_a_compiled_cpu_engine_reads_back_the_keys_it_captured(tiny_llama, llm_factory):
    """vLLM's CPU compilation runs the model as one inductor graph, which reuses the memory
    of a layer's query and key once its attention has run: a prefill pass held by reference
    held other values by the time the commit read it (SmolLM2, compiled: the cache reader's
    check found layer 1's keys different, and the summaries folded from them were as
    wrong). Copied, the keys every layer captured of the prefill equal the KV cache's (the
    check) and the engine drafts from them."""
    from vllm import SamplingParams

    from engine_helpers import assert_drafted

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(300 + 60 * i)]}
               for i in range(3)]  # one prefill pass of 1,080 tokens, above copy_tokens
    spec = dict(SPEC, adaptive=False)
    llm = llm_factory(tiny_llama, speculative_config=spec, enforce_eager=False,
                      max_num_batched_tokens=2048)
    drafter = drafter_of(llm)
    assert drafter.vllm_config.compilation_config.backend == "inductor"
    assert drafter.layer_capture.copy_large_passes
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert_drafted(drafter.stats.snapshot())
    assert drafter.retrieval.keeper.status == "checked (cpu_transposed)"


def test_a_compact_pass_keeps_each_requests_last_rows_and_nothing_of_the_pass():
    """`compact_large_passes` (docstring examples): rows 2, query starts [0, 3, 7] keep rows
    [1, 2, 5, 6]; request 1's row 6 is kept row 3, its row 5 kept row 2; keys of the
    first rows only, as copies: nothing of the pass's own tensors stays alive."""
    import numpy as np
    import torch

    from vllm_triforce.engine.device.capture import LayerCapture

    capture = LayerCapture(num_layers=1, copy_tokens=4)
    capture.compact_large_passes(rows_per_request=2, key_rows=3)
    query, key = torch.randn(7, 2, 4), torch.randn(7, 1, 4)
    capture.record(0, query, key, torch.tensor([0, 3, 7], dtype=torch.int32))
    assert capture.compacted
    assert torch.equal(capture.queries[0], query[[1, 2, 5, 6]])
    assert torch.equal(capture.keys[0], key[:3])
    for kept in (capture.queries[0], capture.keys[0]):
        assert kept.untyped_storage().data_ptr() not in (
            query.untyped_storage().data_ptr(), key.untyped_storage().data_ptr())
    rows = capture.last_rows(np.array([1, 1, 0]), np.array([6, 5, 2]), [0, 3, 7])
    assert rows.tolist() == [3, 2, 1]
    capture.record(0, query[:4], key[:4], torch.tensor([0, 4], dtype=torch.int32))
    assert not capture.compacted and capture.last_rows(np.array([0]), np.array([3]),
                                                       [0, 4]).tolist() == [3]
    # a padded query_start_loc (FLEX's persistent buffer, stale entries after R + 1): the
    # pass's requests keep their rows, the padding's rows stay inside the pass
    padded = torch.tensor([0, 3, 7, 10**6, -5], dtype=torch.int32)
    capture.record(0, query, key, padded)
    assert torch.equal(capture.queries[0][:4], query[[1, 2, 5, 6]])
    assert capture.queries[0].shape[0] == 8 and capture.compacted
    # `when` says no (summaries no longer set from the cache): the pass is kept whole
    capture.compact_large_passes(rows_per_request=2, key_rows=3, when=lambda: False)
    capture.record(0, query, key, torch.tensor([0, 3, 7], dtype=torch.int32))
    assert not capture.compacted and capture.queries[0] is query


def test_compact_prefills_set_the_same_summaries_from_the_cache(tiny_llama, llm_factory):
    """With `prefill_from_cache` (prefills kept compact: here every pass over 64 tokens),
    a prompt's blocks are set from vLLM's KV cache at its prefill instead of folded from its
    keys: every block both engines summarised holds the same summaries, the tokens are the
    same and drafts were verified. Float summaries: coded ones (the default) of the two
    paths agree but for a value whose float sums fall either side of a rounding boundary."""
    import torch
    from vllm import SamplingParams

    from engine_helpers import assert_drafted

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(300 + 60 * i)]}
               for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    runs = {}
    for compact in (False, True):
        spec = dict(SPEC, num_speculative_tokens=4, adaptive=False, prefill_from_cache=compact,
                    compact_summaries=False)
        llm = llm_factory(tiny_llama, speculative_config=spec)
        drafter = drafter_of(llm)
        drafter.layer_capture.copy_tokens = 64
        assert (drafter.layer_capture.compact_rows is not None) == compact
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_drafted(drafter.stats.snapshot())
        assert drafter.retrieval.keeper.lazy
        runs[compact] = ([list(o.outputs[0].token_ids) for o in outs],
                         drafter.summaries.sums.clone(), drafter.summaries.counts.clone(),
                         drafter.block_size, drafter.stats.snapshot()["summarised_blocks"])
    (tokens, sums, counts, bs, read), (c_tokens, c_sums, c_counts, _, c_read) = (runs[False],
                                                                                 runs[True])
    assert c_tokens == tokens
    assert c_read >= read + 3 * 300 // bs  # the prompts' blocks came from the cache
    both = (counts == bs) & (c_counts == bs)  # [num_blocks] full in both engines
    assert both.sum() >= 3 * 300 // bs, "too few blocks summarised: the test proves little"
    torch.testing.assert_close(c_sums[:, both], sums[:, both], rtol=1e-5, atol=1e-5)


def test_a_pass_nobody_reads_is_asked_about_once_and_not_recorded():
    """`reads_pass`, asked at the first layer of each of vLLM's passes: a pass it says
    nobody reads costs that one question (no layer records, nothing stays kept); the
    next pass is asked again; TriForce's own passes (`recording`) are never asked."""
    from types import SimpleNamespace

    import torch

    from vllm_triforce.engine.device.capture import CaptureBuffers, install

    layers = [SimpleNamespace(impl=SimpleNamespace(forward=lambda layer, q, *args, **kw: q))
              for _ in range(3)]
    capture = install(layers)
    asked, answers = [], iter([True, False, True])
    capture.reads_pass = lambda: (asked.append(1), next(answers))[1]
    recorded = []
    record = capture.record
    capture.record = lambda index, *args: (recorded.append(index), record(index, *args))[1]

    def run_pass():
        query, key = torch.randn(2, 2, 4), torch.randn(2, 1, 4)
        for layer in layers:
            layer.impl.forward(layer, query, key, None, None, SimpleNamespace())

    run_pass()  # read: every layer recorded
    assert recorded == [0, 1, 2] and all(q is not None for q in capture.queries)
    recorded.clear()
    run_pass()  # not read: only the question at layer 0; the last pass's values dropped
    assert recorded == [0] and capture.unread
    assert all(q is None for q in capture.queries) and all(k is None for k in capture.keys)
    with capture.recording(into=CaptureBuffers(3, max_tokens=4, keep_keys=False)):
        recorded.clear()
        run_pass()  # a middle pass: recorded, not asked
        assert recorded == [0, 1, 2] and len(asked) == 2
    recorded.clear()
    run_pass()  # vLLM's next pass: asked again, read
    assert recorded == [0, 1, 2] and len(asked) == 3 and not capture.unread
