"""FULL decode graphs for TriForce on Model Runner V2 (vllm_triforce/engine/mrv2/graphs.py):
which passes vLLM may replay as one graph, decided before the pass from the host facts the
speculator decides its step by. No engine: MRV2 cannot run on a CPU (its kernels are
Triton); vLLM's own graph manager is built without a GPU (its `__init__` reads the
distributed groups), and its own candidate and dispatch code runs.

The manager's shape: K = 3 draft slots (decode query length 4), at most 8 requests, CUDA-graph
sizes 1, 2, 4, 8, 16, 32.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from vllm_triforce.engine.mrv2.graphs import (CaptureDemotion, takes_full_decode,
                                              use_varlen_decode)
from vllm_triforce.engine.plain_steps import PlainSteps

K, MAX_REQS, SIZES = 3, 8, [1, 2, 4, 8, 16, 32]


def graph_manager(mode=CUDAGraphMode.FULL_AND_PIECEWISE) -> CudaGraphManager:
    """vLLM's CudaGraphManager with the fields its candidates and dispatch read, its graphs
    taken as captured."""
    manager = object.__new__(CudaGraphManager)
    compilation = types.SimpleNamespace(cudagraph_capture_sizes=SIZES,
                                        max_cudagraph_capture_size=max(SIZES))
    manager.vllm_config = types.SimpleNamespace(
        speculative_config=None, cache_config=types.SimpleNamespace(use_kda_recoverssm=False))
    manager.compilation_config = compilation
    manager.max_num_reqs, manager.decode_query_len = MAX_REQS, 1 + K
    manager.cudagraph_mode, manager.varlen_decode = mode, False
    manager.lora_capture_cases, manager.ubatch_runner = [0], None
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    manager._graphs_captured = True
    return manager


def dispatched(manager, num_reqs, tokens_each: int, max_query_len=None):
    num_tokens = num_reqs * tokens_each
    uniform = tokens_each
    return manager.dispatch(num_reqs, num_tokens, uniform, 0,
                            max_query_len=max_query_len or tokens_each)


def test_only_full_and_piecewise_replays_decodes_as_full_and_the_rest_piecewise():
    assert takes_full_decode(graph_manager())
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                 CUDAGraphMode.NONE):
        assert not takes_full_decode(types.SimpleNamespace(cudagraph_mode=mode)), mode


def test_variable_length_graphs_take_plain_and_mixed_steps():
    """vLLM's default FULL decode graphs take only 1 + K tokens per request: a plain step
    (1 token each) falls to the piecewise graphs. With variable-length ones it replays
    FULL, and so does a step of mixed depths."""
    manager = graph_manager()
    assert dispatched(manager, 4, 1 + K).cg_mode == CUDAGraphMode.FULL
    assert dispatched(manager, 4, 1).cg_mode == CUDAGraphMode.PIECEWISE
    use_varlen_decode(manager)
    assert dispatched(manager, 4, 1).cg_mode == CUDAGraphMode.FULL
    mixed = manager.dispatch(3, 1 + 2 + 4, None, 0, max_query_len=4)  # depths 0, 1, 3
    assert mixed.cg_mode == CUDAGraphMode.FULL and mixed.max_query_len == 1 + K
    prefill = manager.dispatch(2, 30, None, 0, max_query_len=None)  # a prefill in it
    assert prefill.cg_mode == CUDAGraphMode.PIECEWISE
    use_varlen_decode(manager)  # once is enough
    assert manager.varlen_decode


def test_a_pass_triforce_reads_runs_piecewise():
    manager = graph_manager()
    use_varlen_decode(manager)
    demotion = CaptureDemotion(manager)
    assert dispatched(manager, 4, 1).cg_mode == CUDAGraphMode.FULL
    demotion.needs_capture = True
    for tokens_each in (1, 1 + K):
        desc = dispatched(manager, 4, tokens_each)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE and desc.num_tokens >= 4 * tokens_each
    demotion.needs_capture = False
    assert dispatched(manager, 4, 1 + K).cg_mode == CUDAGraphMode.FULL


def test_the_facts_before_the_pass_are_the_facts_after_it():
    """`read_mrv2_ahead` (from MRV2's BatchReqState, before the pass) equals `read_mrv2`
    (from the pass's InputBatch, after it) on the hand-worked step of test_mrv2_adapter."""
    from test_mrv2_adapter import COMPUTED, PROMPTS, OUTPUTS, ROWS, SCHEDULED, SLOTS
    from test_mrv2_adapter import mrv2_input_batch

    computed_by_slot = np.zeros(4, dtype=np.int32)
    for r in ROWS:
        computed_by_slot[SLOTS[r]] = COMPUTED[r]
    state = types.SimpleNamespace(
        req_ids=list(ROWS), idx_mapping_np=np.array([SLOTS[r] for r in ROWS]),
        num_scheduled_tokens=np.array([len(SCHEDULED[r]) for r in ROWS], dtype=np.int32),
        prefill_len_np=np.array([len(PROMPTS[r]) + len(OUTPUTS[r]) for r in ROWS]))
    ahead = PlainSteps.read_mrv2_ahead(state, computed_by_slot)
    after = PlainSteps.read_mrv2(mrv2_input_batch())
    assert ahead.req_ids == after.req_ids
    for name in ("query_start_loc", "seq_lens", "decoding"):
        assert getattr(ahead, name).tolist() == getattr(after, name).tolist(), name


@pytest.fixture(scope="module")
def binding():
    from vllm_triforce.engine.mrv2 import speculator
    return speculator


@pytest.mark.parametrize("decided", [True, False])
def test_propose_takes_the_decision_made_before_the_pass(binding, decided):
    """The hand-worked step is a working step by its facts at a 2-block budget and a plain
    one at 8 blocks; whatever was decided before the pass (`plan_pass`) is what the step
    does, so a pass replayed FULL (not captured) is never worked on."""
    from test_mrv2_adapter import mrv2_input_batch, mrv2_records, mrv2_sampled
    from test_mrv2_adapter import speculator_stand_in

    this = speculator_stand_in(mrv2_records(), budget_blocks=8 if not decided else 2)
    # the opposite of what the facts say, decided before the pass
    this._pass_plain = decided
    binding.TriForceSpeculator.propose(this, mrv2_input_batch(), {}, {}, None, None,
                                       *mrv2_sampled(), None, None, None,
                                       num_speculative_tokens=K)
    assert bool(this.plain_done) == decided and bool(this.stepped) == (not decided)
    assert this._pass_plain is None  # asked again next step


def test_the_runner_asks_before_each_pass(binding, monkeypatch):
    """TriForceRunnerV2.gather_batch_req_state: vLLM's batch state, then the speculator's
    `plan_pass` on its facts; a pass it reads needs the capture (runs piecewise), a plain
    one does not, and a dummy run's (no state) does not either."""
    state = types.SimpleNamespace(req_ids=["a"], idx_mapping_np=np.array([0]),
                                  num_scheduled_tokens=np.array([1]),
                                  prefill_len_np=np.array([5]))
    monkeypatch.setattr(binding.GPUModelRunnerV2, "gather_batch_req_state",
                        lambda self, out, dummy: (None if dummy else state, 1))
    runner = object.__new__(binding.TriForceRunnerV2)  # vLLM's __init__ needs a GPU
    asked = []
    runner.speculator = types.SimpleNamespace(
        plan_pass=lambda facts, slots: asked.append((facts, slots)) or facts.seq_lens[0] < 10)
    runner.req_states = types.SimpleNamespace(num_computed_tokens_np=np.array([7]))
    runner.capture_demotion = types.SimpleNamespace(needs_capture=None)
    assert runner.gather_batch_req_state(None, False) == (state, 1)
    facts, slots = asked[0]
    assert facts.seq_lens.tolist() == [8] and facts.decoding.tolist() == [True]
    assert slots is state.idx_mapping_np  # where the sampler's states say who is seeded
    assert runner.capture_demotion.needs_capture is False  # plain: FULL may take it
    runner.req_states.num_computed_tokens_np = np.array([20])
    runner.gather_batch_req_state(None, False)
    assert runner.capture_demotion.needs_capture is True  # read: piecewise
    runner.gather_batch_req_state(None, True)
    assert runner.capture_demotion.needs_capture is False and len(asked) == 2


def test_nothing_of_vllms_is_recorded_while_vllm_captures_a_graph(monkeypatch):
    """With `skip_while_capturing`, a pass under stream capture outside TriForce's own
    `recording(into=...)` records nothing (no copy baked into vLLM's graph); TriForce's
    own capture into its buffers still records; outside stream capture all records."""
    from vllm_triforce.engine.device import capture as capture_mod

    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    layer = types.SimpleNamespace(impl=types.SimpleNamespace(
        forward=lambda layer, q, k, v, kv, meta, *a, **kw: q))
    layer_capture = capture_mod.install([layer])
    layer_capture.skip_while_capturing = True
    q, k = torch.ones(2, 4), torch.ones(2, 4)
    meta = types.SimpleNamespace(query_start_loc=None)
    layer.impl.forward(layer, q, k, None, None, meta)
    assert layer_capture.queries == [None]
    into = capture_mod.CaptureBuffers(1, 8, keep_keys=False)
    with layer_capture.recording(into=into):
        layer.impl.forward(layer, q, k, None, None, meta)
    assert layer_capture.queries[0] is not None
    layer_capture.clear()
    capturing["now"] = False
    layer.impl.forward(layer, q, k, None, None, meta)
    assert layer_capture.queries[0] is not None and layer_capture.keys[0] is not None


@pytest.mark.parametrize("mode,varlen_ok", [(CUDAGraphMode.FULL_AND_PIECEWISE, True),
                                            (CUDAGraphMode.FULL_AND_PIECEWISE, False),
                                            (CUDAGraphMode.PIECEWISE, True)])
def test_the_runner_sets_the_graphs_up_after_vllms_kv_cache(binding, monkeypatch, mode,
                                                            varlen_ok):
    """TriForceRunnerV2.initialize_kv_cache: under FULL_AND_PIECEWISE, variable-length
    decode graphs where every backend replays them, the demotion of passes TriForce reads,
    and no recording while vLLM captures; under PIECEWISE nothing changes. In every mode the
    speculator then compiles what needs the bound cache (`compiled_selection`'s lazy
    read)."""
    monkeypatch.setattr(binding.GPUModelRunnerV2, "initialize_kv_cache",
                        lambda self, *args, **kwargs: None)
    monkeypatch.setattr(binding, "get_varlen_cudagraph_unsupported_backend",
                        lambda groups, config, max_query_len:
                        None if varlen_ok else ("TRITON_ATTN", None))
    runner = object.__new__(binding.TriForceRunnerV2)
    runner.cudagraph_manager = manager = graph_manager(mode)
    runner.attn_groups, runner.vllm_config, runner.decode_query_len = [], None, 1 + K
    compiled = []
    runner.speculator = types.SimpleNamespace(
        layer_capture=types.SimpleNamespace(skip_while_capturing=False),
        _compile_after_binding=lambda: compiled.append(True))
    runner.initialize_kv_cache(None)
    assert compiled == [True]  # the lazy summaries' read, once the cache is bound
    full = mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert (runner.capture_demotion is not None) == full
    assert runner.speculator.layer_capture.skip_while_capturing == full
    assert manager.varlen_decode == (full and varlen_ok)
    if full:
        runner.capture_demotion.needs_capture = True
        assert dispatched(manager, 4, 1 + K).cg_mode == CUDAGraphMode.PIECEWISE
