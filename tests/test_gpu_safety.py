"""Safe on GPUs by construction, proven where CPU can prove it.

- Settings that break TriForce on CUDA are refused at config time, before any weights
  load, with one error naming "TriForce", the setting and the fix; the safe defaults
  (PIECEWISE CUDA graphs, async scheduling off, V1 runner) are chosen when unset. These
  checks read the user's request, not the platform, so they fire on CPU too.
- No pass the proposer builds exceeds `max_num_batched_tokens` (the compiled range on CUDA).
- TriForce's own buffers are reserved before vLLM sizes the KV cache.
"""

import itertools
import types

import pytest
import torch

import tiny_models
import vllm_triforce
from engine_helpers import (assert_drafted, drafter_of, free_llm, in_process_llm,
                            make_engine_kwargs, runner_of)
from vllm_triforce.config import TriForceConfig, TriForceConfigError
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.policy_facts import SummaryKinds
from vllm_triforce.engine.device.forward import PassInputs, run, split_pass
from vllm_triforce.engine.shape import EngineShape

SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
        "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32}


def _engine_args(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    vllm_triforce.register()
    return EngineArgs(model=str(model), speculative_config=dict(SPEC), max_model_len=1024,
                      **kw)


# ---- 1. refusals and safe defaults ----------------------------------------------------
def _settings_args(cudagraph_mode, async_scheduling):
    """What `engine_settings.decide` reads of the engine's arguments and of its parallel
    config, as a user left them (worker class "auto", no attention backend named)."""
    args = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=cudagraph_mode),
        async_scheduling=async_scheduling, worker_cls="auto", attention_backend=None,
        attention_config=None)
    return args, types.SimpleNamespace(data_parallel_size=1, worker_cls="auto")


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cuda_graphs_refused(tiny_llama, mode):
    with pytest.raises(TriForceConfigError,
                       match=rf"TriForce cannot run with cudagraph_mode={mode}.*PIECEWISE"):
        _engine_args(tiny_llama, compilation_config={"cudagraph_mode": mode}
                     ).create_engine_config()


def test_async_scheduling_refused(tiny_llama):
    with pytest.raises(TriForceConfigError, match=r"TriForce.*async_scheduling=True.*Fix"):
        _engine_args(tiny_llama, async_scheduling=True).create_engine_config()


def test_v2_model_runner_is_refused_on_cpu_naming_the_setting(tiny_llama, monkeypatch):
    """vLLM's own V2 switch asks for TriForce's Model Runner V2 binding, which needs
    Triton: on this CPU the error names the variable the user set and the fix."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.delenv("VLLM_TRIFORCE_MRV2", raising=False)
    with pytest.raises(TriForceConfigError,
                       match=r"TriForce cannot run with VLLM_USE_V2_MODEL_RUNNER=1 on cpu.*"
                             r"Triton.*Fix: unset VLLM_USE_V2_MODEL_RUNNER"):
        _engine_args(tiny_llama).create_engine_config()


def test_v2_model_runner_alone_picks_triforces_binding(monkeypatch):
    """On a GPU (the platform check stood in for) an explicit VLLM_USE_V2_MODEL_RUNNER=1 is
    taken as asking for TriForce on Model Runner V2, as VLLM_TRIFORCE_MRV2=1 is: TriForce's
    worker, the draft logits MRV2's verifier reads, FULL_AND_PIECEWISE and async scheduling
    taken, and the start-up line names the variable that chose it."""
    from vllm_triforce import engine_settings

    checked = []
    monkeypatch.setattr(engine_settings, "_check_mrv2_switch", checked.append)
    monkeypatch.delenv("VLLM_TRIFORCE_MRV2", raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    args, parallel = _settings_args("FULL_AND_PIECEWISE", True)
    assert engine_settings.decide(args, parallel) == ["model_runner"]
    assert checked == [args] and parallel.worker_cls == engine_settings.MRV2_WORKER
    assert engine_settings.mrv2_keys({})["draft_sample_method"] == "probabilistic"
    config = types.SimpleNamespace(
        compilation_config=args.compilation_config,
        model_config=types.SimpleNamespace(enforce_eager=False),
        scheduler_config=types.SimpleNamespace(async_scheduling=True))
    line = engine_settings.describe(config, "FLASH_ATTN", ["model_runner"])
    assert "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, experimental)" in line
    # set to 0 (or unset: TriForce sets 0) it is the V1 runner, as before
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    parallel.worker_cls = "auto"
    args.compilation_config.cudagraph_mode, args.async_scheduling = "PIECEWISE", None
    assert engine_settings.decide(args, parallel) == ["async_scheduling"]
    assert parallel.worker_cls == "auto" and not engine_settings.mrv2_requested()


def test_the_mrv2_switch_is_refused_where_mrv2_cannot_run(tiny_llama, monkeypatch):
    """Model Runner V2 needs Triton; on this CPU the switch gets TriForce's error, with the
    fix, before any weights load."""
    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    with pytest.raises(TriForceConfigError,
                       match=r"VLLM_TRIFORCE_MRV2=1 on cpu.*Triton.*Fix: unset VLLM_TRIFORCE_MRV2"):
        _engine_args(tiny_llama).create_engine_config()


def test_the_mrv2_switch_picks_v2_and_triforces_worker(monkeypatch):
    """What the switch decides on a GPU (the platform check stood in for): vLLM's V2
    runner and TriForce's worker class, unless the user chose another worker or V1."""
    from vllm_triforce import engine_settings

    monkeypatch.setattr(engine_settings, "_check_mrv2_switch", lambda args: None)
    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    args, parallel = _settings_args("PIECEWISE", False)
    assert engine_settings.decide(args, parallel) == ["model_runner"]
    import os
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert parallel.worker_cls == engine_settings.MRV2_WORKER
    from vllm_triforce.engine.mrv2 import speculator  # the class the name names
    assert engine_settings.MRV2_WORKER.endswith(speculator.TriForceWorker.__qualname__)
    # MRV2 keeps the draft logits its verifier reads
    assert engine_settings.mrv2_keys({"revision": "r"}) == {
        "revision": "r", "draft_sample_method": "probabilistic"}
    monkeypatch.delenv("VLLM_TRIFORCE_MRV2")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # the switch set it: V2 asked for
    assert engine_settings.mrv2_keys({"revision": "r"}) == {"revision": "r"}


def test_an_explicit_async_scheduling_is_taken_only_on_model_runner_v2(monkeypatch):
    """MRV2's runner cuts async scheduling's K placeholder drafts to each request's depth
    (engine/mrv2/draft_tokens.py): with the switch an explicit --async-scheduling stays
    on (off is still TriForce's default); without it, the error names the switch."""
    from vllm_triforce import engine_settings

    monkeypatch.setattr(engine_settings, "_check_mrv2_switch", lambda args: None)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test

    def decided(async_scheduling):
        args, parallel = _settings_args("PIECEWISE", async_scheduling)
        return engine_settings.decide(args, parallel), args.async_scheduling

    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    assert decided(True) == (["model_runner"], True)
    assert decided(None) == (["async_scheduling", "model_runner"], False)
    monkeypatch.delenv("VLLM_TRIFORCE_MRV2")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # the switch set it: V2 asked for
    with pytest.raises(TriForceConfigError, match=r"async_scheduling=True.*VLLM_TRIFORCE_MRV2=1"):
        decided(True)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_model_runner_v2_takes_full_and_piecewise_graphs_and_no_other_full_mode(monkeypatch,
                                                                               mode):
    """engine/mrv2/graphs.py: FULL decode graphs where TriForce reads nothing of a pass,
    piecewise where it does; so with the switch an explicit FULL_AND_PIECEWISE is taken,
    and FULL (mixed batches FULL too) or FULL_DECODE_ONLY (no piecewise graphs to fall
    back on) are still refused. Without the switch every FULL mode is refused, naming it."""
    from vllm_triforce import engine_settings

    monkeypatch.setattr(engine_settings, "_check_mrv2_switch", lambda args: None)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    args, parallel = _settings_args(mode, None)
    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    if mode == "FULL_AND_PIECEWISE":
        assert "cudagraph_mode" not in engine_settings.decide(args, parallel)
        assert args.compilation_config.cudagraph_mode == mode
    else:
        with pytest.raises(TriForceConfigError, match=rf"cudagraph_mode={mode}.*Fix"):
            engine_settings.decide(args, parallel)
    monkeypatch.delenv("VLLM_TRIFORCE_MRV2")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # the switch set it: V2 asked for
    with pytest.raises(TriForceConfigError, match=r"FULL_AND_PIECEWISE is taken"):
        engine_settings.decide(args, parallel)


def test_data_parallel_refused(tiny_llama):
    with pytest.raises(TriForceConfigError, match=r"TriForce.*data_parallel_size=2.*Fix"):
        _engine_args(tiny_llama, data_parallel_size=2).create_engine_config()


def test_lora_taken_in_the_v1_runner_refused_on_model_runner_v2(tiny_llama, monkeypatch):
    """TriForce maps its passes' tokens to their adapters in the V1 runner
    (tests/test_lora.py runs them); its Model Runner V2 binding does not."""
    from vllm_triforce import engine_settings

    _engine_args(tiny_llama, enable_lora=True, max_lora_rank=8).create_engine_config()
    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    with pytest.raises(TriForceConfigError, match=r"TriForce cannot run with enable_lora=True "
                                                  r"with VLLM_TRIFORCE_MRV2=1.*Fix: unset "
                                                  r"VLLM_TRIFORCE_MRV2"):
        engine_settings._check_lora(True)


def test_prompt_embeds_refused_before_weights_load(tiny_llama):
    """Without the refusal the step that ends a prompt-embeds request's prefill fails in
    vLLM's `prepare_next_token_ids_padded` (its last prompt token has no id), with TriForce
    as with vLLM's own draft_model method."""
    with pytest.raises(TriForceConfigError, match=r"TriForce cannot run with "
                                                  r"enable_prompt_embeds=True.*Fix: send prompts"):
        _engine_args(tiny_llama, enable_prompt_embeds=True).create_engine_config()


def test_sliding_window_layers_taken_in_the_target_refused_in_a_small_draft(tiny_llama,
                                                                           tmp_path):
    """A model with sliding-window layers beside its full-attention ones (Gemma 2 and 3,
    gpt-oss) is taken as a two-level target (tests/test_window_layers.py runs one); as a
    small draft, or with no full-attention layer, it is refused when vLLM builds the
    config, before weights load."""
    from vllm.engine.arg_utils import EngineArgs

    hybrid = tiny_models.build_tiny_llama(
        tmp_path / "hybrid", num_layers=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2)
    _engine_args(hybrid).create_engine_config()
    with pytest.raises(TriForceConfigError, match=r"the small draft .*hybrid: not all its "
                                                  r"layers have full attention \(2 "
                                                  r"full_attention, 2 sliding_attention\).*"
                                                  r"Fix: draft with a model that has full"):
        EngineArgs(model=str(tiny_llama), max_model_len=1024,
                   speculative_config={**SPEC, "model": str(hybrid)}).create_engine_config()
    sliding = tiny_models.build_tiny_llama(
        tmp_path / "sliding", num_layers=2, sliding_window=128,
        layer_types=["sliding_attention"] * 2)
    with pytest.raises(TriForceConfigError, match=r"the target .*sliding: none of its layers "
                                                  r"has full attention.*Fix: serve this"):
        _engine_args(sliding).create_engine_config()


def test_a_sliding_window_in_every_layer_refused_where_it_is_shorter_than_the_context(
        tmp_path):
    """vLLM gives every layer of a model with a `sliding_window` (and no `layer_types`) that
    window, and frees the blocks behind it (Mistral 7B v0.1): refused where the window is
    shorter than max_model_len; a window that holds the whole context is full attention."""
    sliding = tiny_models.build_tiny_llama(tmp_path / "sliding", sliding_window=256)
    with pytest.raises(TriForceConfigError, match=r"every layer attends to the last 256 "
                                                  r"tokens of a context of up to 1024"):
        _engine_args(sliding).create_engine_config()
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model=str(sliding), speculative_config=dict(SPEC, retrieval_budget=128),
               max_model_len=256, block_size=16).create_engine_config()


@pytest.mark.parametrize("text, flags, named", [
    ({"attention_chunk_size": 8192}, {}, "attends in chunks of 8192 tokens"),
    ({}, {"is_hybrid": True}, "Mamba or linear-attention layers"),
    ({}, {"use_mla": True}, "multi-head latent attention"),
    ({"layer_types": ["full_attention", "linear_attention"]}, {},
     r"1 full_attention, 1 linear_attention"),
])
def test_what_a_config_says_of_its_attention_refused(text, flags, named):
    from vllm_triforce import engine_settings

    with pytest.raises(TriForceConfigError, match=named):
        engine_settings.check_attention(
            _plain_model(hf_text_config=types.SimpleNamespace(**text),
                         **{"is_hybrid": False, "use_mla": False, **flags}), "the target",
            4096, windows=True)
    engine_settings.check_attention(_plain_model(hf_text_config=types.SimpleNamespace(
        layer_types=["full_attention"] * 2)), "the target", 4096, windows=False)


@pytest.mark.parametrize("lora, embeds, refused", [
    (object(), False, "enable_lora=True with VLLM_TRIFORCE_MRV2=1"),
    (None, True, "enable_prompt_embeds=True")])
def test_lora_on_mrv2_or_prompt_embeds_in_a_built_config_refused(lora, embeds, refused,
                                                                 monkeypatch):
    from vllm_triforce import engine_settings

    if lora is not None:
        monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=None),
        scheduler_config=types.SimpleNamespace(async_scheduling=False),
        parallel_config=types.SimpleNamespace(data_parallel_size=1), lora_config=lora,
        model_config=_plain_model(enable_prompt_embeds=embeds),
        speculative_config=types.SimpleNamespace(draft_model_config=None),
        additional_config=None)
    with pytest.raises(TriForceConfigError, match=refused):
        engine_settings.check_effective(config)
    engine_settings.check_effective(types.SimpleNamespace(
        **{**vars(config), "lora_config": None,
           "model_config": _plain_model(enable_prompt_embeds=False)}))


def _plain_model(**kw):
    """What `check_effective` reads of a model's config: one of full attention, 1-D RoPE."""
    fields = dict(model="m", uses_mrope=False, is_hybrid=False, use_mla=False,
                  hf_text_config=types.SimpleNamespace(), max_model_len=4096,
                  get_sliding_window=lambda: None)
    return types.SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize("setting,kw", [
    # vLLM needs tensor_parallel_size divisible by the DCP size (vllm/config/parallel.py).
    ("decode_context_parallel_size", {"tensor_parallel_size": 2}),
    ("prefill_context_parallel_size", {}),
])
def test_context_parallel_refused(tiny_llama, setting, kw):
    with pytest.raises(TriForceConfigError,
                       match=rf"TriForce.*{setting}=2.*Fix: leave {setting}=1"):
        _engine_args(tiny_llama, **{setting: 2}, **kw).create_engine_config()


def test_attention_backend_outside_allow_list_refused(tiny_llama):
    with pytest.raises(TriForceConfigError,
                       match=r"TriForce cannot run with attention backend TREE_ATTN.*FLASH_ATTN"):
        _engine_args(tiny_llama, attention_backend="TREE_ATTN").create_engine_config()


@pytest.mark.parametrize("policy", ["topk_oracle", "h2o"])
def test_full_key_copy_policies_need_opt_in(policy):
    with pytest.raises(TriForceConfigError, match=r"selection_policy.*allow_full_key_copy"):
        TriForceConfig.from_speculative_config({**SPEC, "selection_policy": policy})
    TriForceConfig.from_speculative_config({**SPEC, "selection_policy": policy,
                                            "allow_full_key_copy": True})


def test_rerank_reads_vllms_cache_and_needs_no_key_copy():
    cfg = TriForceConfig.from_speculative_config({**SPEC, "selection_policy": "rerank"})
    assert not make_policy(cfg.selection_policy, **cfg.policy_kwargs()).needs_keys


def test_safe_defaults_chosen_when_unset(tiny_llama, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = _engine_args(tiny_llama)
    config = args.create_engine_config()
    # What TriForce asked vLLM for (CPU then turns CUDA graphs off altogether).
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert args.async_scheduling is False
    assert config.scheduler_config.async_scheduling is False
    assert config.additional_config["triforce_forced_settings"] == [
        "cudagraph_mode", "async_scheduling", "model_runner"]
    import os
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_explicit_safe_choices_are_kept(tiny_llama):
    from vllm.config.compilation import CUDAGraphMode

    args = _engine_args(tiny_llama, compilation_config={"cudagraph_mode": "NONE"},
                        async_scheduling=False)
    config = args.create_engine_config()
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "cudagraph_mode" not in config.additional_config["triforce_forced_settings"]


# ---- 3. no pass larger than the compiled range ----------------------------------------
def _inputs(q_lens, seq_lens, sample_rows):
    n = sum(q_lens)
    qsl = [0, *itertools.accumulate(q_lens)]
    return PassInputs.make(qsl, seq_lens, sample_rows,
                           input_ids=torch.arange(n, dtype=torch.int32),
                           positions=torch.arange(n), slot_mapping=torch.arange(n))


def test_split_pass_worked_example():
    # The docstring's example: queries of 3 and 5 tokens, at most 4 tokens per chunk.
    inputs = _inputs([3, 5], [10, 20], sample_rows=[2, 7])
    chunks = list(split_pass(inputs, 4))
    assert [c.num_tokens for c, _ in chunks] == [4, 4]
    first, rows0 = chunks[0]
    assert list(rows0) == [0, 1] and first.query_start_loc == [0, 3, 4]
    assert first.seq_lens == [10, 16]  # request 1 holds 1 of its 5 query tokens
    assert first.seq_lens_dev.tolist() == [10, 16]
    assert first.sample_rows == [2] and first.sample_rows_dev.tolist() == [2]
    second, rows1 = chunks[1]
    assert list(rows1) == [1] and second.seq_lens == [20]
    assert second.input_ids.tolist() == [4, 5, 6, 7] and second.sample_rows == [3]


def test_split_pass_leaves_small_passes_alone():
    inputs = _inputs([3, 5], [10, 20], sample_rows=[2, 7])
    [(chunk, rows)] = list(split_pass(inputs, 8))
    assert chunk is inputs and list(rows) == [0, 1]


def test_split_pass_by_requests():
    """Per-layer builders take at most `max_reqs` requests a pass: five one-token requests,
    at most two per chunk (and 8 tokens), give chunks of rows 0-1, 2-3, 4."""
    inputs = _inputs([1] * 5, [10, 11, 12, 13, 14], sample_rows=[0, 1, 2, 3, 4])
    chunks = list(split_pass(inputs, 8, max_reqs=2))
    assert [list(rows) for _, rows in chunks] == [[0, 1], [2, 3], [4]]
    assert [c.seq_lens for c, _ in chunks] == [[10, 11], [12, 13], [14]]
    assert [c.input_ids.tolist() for c, _ in chunks] == [[0, 1], [2, 3], [4]]
    assert [c.sample_rows for c, _ in chunks] == [[0, 1], [0, 1], [0]]


def test_run_asserts_the_compiled_range():
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4))
    with pytest.raises(AssertionError, match="exceeds max_num_batched_tokens=4"):
        run(model=None, vllm_config=config, metas={}, inputs=_inputs([3, 2], [3, 2], [4]))


@pytest.mark.engine
def test_three_level_refills_larger_than_max_num_batched_tokens(tiny_qwen2, tiny_draft):
    """A draft window refill (sinks + 96-token window) exceeds a 64-token compiled range.
    Fixed depth (adaptive off): every step drafts, so the small draft runs and refills."""
    from vllm import SamplingParams

    import tiny_models

    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate((260, 400, 120))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    limit = dict(max_num_batched_tokens=64, max_num_seqs=3)
    spec = {**SPEC, "model": str(tiny_draft), "draft_window_tokens": 96,
            "draft_tokens_per_round": 2, "adaptive": False}
    outputs = {}
    for name, speculative in (("plain", None), ("triforce", spec)):
        llm = in_process_llm(tiny_qwen2, speculative, **make_engine_kwargs(**limit))
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
            stats = drafter_of(llm).stats.snapshot() if speculative else None
        finally:
            free_llm(llm)
    assert outputs["triforce"] == outputs["plain"]
    assert_drafted(stats, levels=3)
    assert stats["split_passes"] > 0  # refills really exceeded the range and were split
    assert 0 < stats["max_pass_tokens"] <= 64


# ---- 4. memory accounted before vLLM sizes the KV cache -------------------------------
def smollm2_plan(kv_dtype_bytes=4, max_num_seqs=8, **summaries):
    """MemoryPlan of engine/memory.py's worked example (SmolLM2-135M, 8 requests, gamma2 6,
    no selection or fold scratch), from the engine shape's sizes."""
    shape = EngineShape.from_sizes(
        num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49152, block_size=32,
        max_num_seqs=max_num_seqs, cfg=TriForceConfig(num_speculative_tokens=6),
        summary_dtype={4: torch.float32, 2: torch.bfloat16}[kv_dtype_bytes],
        kinds=SummaryKinds(**summaries))
    return shape.memory_plan(30 * 2 * 32 * 3 * 64 * kv_dtype_bytes, backend=None)


def test_memory_plan_worked_example():
    """engine/memory.py's docstring example, SmolLM2-135M float32."""
    plan = smollm2_plan()
    assert plan.summary_bytes_per_block == 23_044
    assert plan.fixed_bytes == 249 * 49_152 * 4 == 48_955_392
    assert plan.sized(684).drafting == 8  # within 1/16 of the KV: every request drafts
    assert plan.kv_budget(2**30) == 684 * 1_474_560
    assert 2**30 - plan.kv_budget(2**30) == 65_142_784
    quest = smollm2_plan(keep_bounds=True)  # selection_policy "quest": min + max
    assert quest.summary_bytes_per_block == 69_124
    assert quest.kv_budget(2**30) == 663 * 1_474_560
    variance = smollm2_plan(keep_variance=True)  # key_variance, compact_summaries false
    assert variance.summary_bytes_per_block == 46_084
    assert variance.kv_budget(2**30) == 673 * 1_474_560
    coded = smollm2_plan(keep_variance=True, coded=True)  # both defaults on a GPU
    assert coded.summary_bytes_per_block == 2 * 30 * 3 * (64 + 4) + 4 == 12_244
    assert coded.kv_budget(2**30) == 689 * 1_474_560
    compact = smollm2_plan(keep_variance=True, compact_variance=True)  # compact_key_variance
    assert compact.summary_bytes_per_block == 23_044 + 30 * 3 * 8 * 4 == 25_924
    assert compact.fixed_bytes == 48_955_392 + 30 * 3 * 64 * 4  # the channel profile
    assert compact.kv_budget(2**30) == 682 * 1_474_560
    bf16 = smollm2_plan(kv_dtype_bytes=2, keep_variance=True)  # deviations stay float32
    assert bf16.summary_bytes_per_block == 11_520 + 23_040 + 4


@pytest.mark.engine
def test_reservation_is_computed_and_applied(tiny_llama):
    """The KV cache vLLM builds under TriForce is the 1 GiB budget less the reservation."""
    kwargs = make_engine_kwargs(max_num_seqs=4)
    blocks = {}
    for name, spec in (("plain", None), ("triforce", dict(SPEC))):
        llm = in_process_llm(tiny_llama, spec, **kwargs)
        try:
            blocks[name] = runner_of(llm).kv_cache_config.num_blocks
            if spec:
                drafter = drafter_of(llm)
                plan = drafter.memory_plan()
                reserved = drafter.reserved_bytes
                summaries = drafter.summaries
        finally:
            free_llm(llm)
    budget = 2**30  # VLLM_CPU_KVCACHE_SPACE=1 in tests/conftest.py
    assert reserved == budget - plan.kv_budget(budget) > 0
    assert blocks["triforce"] == plan.kv_budget(budget) // plan.kv_bytes_per_block
    assert blocks["triforce"] < blocks["plain"]
    # what was reserved covers what was allocated
    assert summaries.nbytes() <= (blocks["triforce"] * plan.summary_bytes_per_block
                                  + plan.sized(blocks["triforce"]).profile_bytes)
    assert summaries.dtype == torch.float32  # the KV cache's dtype in this engine
    assert summaries.square_deviations is not None  # key_variance, the default
    assert not summaries.coded  # compact_summaries left out: float on a CPU


@pytest.mark.parametrize("host", ["drafter", "speculator"])
def test_the_reservation_asks_either_runners_triforce_host(host):
    """patches/kv_reservation.py: the V1 runner's `drafter` or Model Runner V2's
    `speculator` (VLLM_TRIFORCE_MRV2=1) leaves what it reserves; another engine's runner,
    or a speculator that is not TriForce's, gets vLLM's budget unchanged."""
    from vllm_triforce.engine.drafting import Drafting
    from vllm_triforce.patches import kv_reservation

    class Host(Drafting):  # a TriForce host reserving 300 bytes, nothing else built
        def reserve_memory(self, available):
            return available - 300

    wrapped = kv_reservation._make_wrapper(lambda self: 1000)
    triforce = Host()
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(**{host: triforce}))
    assert wrapped(worker) == 700
    stock = types.SimpleNamespace(model_runner=types.SimpleNamespace(**{host: object()}))
    assert wrapped(stock) == 1000
    assert wrapped(types.SimpleNamespace(model_runner=types.SimpleNamespace())) == 1000


@pytest.mark.engine
def test_a_build_while_vllm_sizes_the_kv_cache_compiles_nothing(tiny_llama, monkeypatch):
    """On a GPU, vLLM's CUDA-graph memory profile builds the proposer over a minimal KV
    cache inside `determine_available_memory`, before the real build: patches/
    kv_reservation.py marks that time, and a build in it leaves compiled_sampling's and
    compiled_selection's compilations (tens of seconds each on a GPU) to the real build.
    The CPU makes no such build, so the test makes it the way vLLM's profile does, through
    the patch's wrapper: nothing compiles; then the real build compiles everything."""
    from vllm_triforce.engine.drafting import Drafting
    from vllm_triforce.engine.summary_keeper import BlockReads
    from vllm_triforce.patches import kv_reservation

    calls = []
    for name in ("_compile_sampling", "_compile_scoring", "_build_selection_graphs"):
        monkeypatch.setattr(Drafting, name, lambda self, name=name: calls.append(name))
    monkeypatch.setattr(BlockReads, "compile_when_bound",
                        lambda self, *args: calls.append("compile_when_bound"))
    spec = dict(SPEC, compiled_sampling=True, compiled_selection=True)
    llm = in_process_llm(tiny_llama, spec, **make_engine_kwargs(max_num_seqs=4))
    try:
        drafter, runner = drafter_of(llm), runner_of(llm)
        assert "_compile_scoring" in calls  # the engine's own build compiled
        groups = [g for attn_groups in runner.attn_groups for g in attn_groups]

        def rebuild():
            drafter._build_drafting(runner.kv_cache_config, groups)
            drafter._compile_after_binding()  # the warm-up of vLLM's profile captures

        def sizing(worker):  # vLLM's sizing, with its profile's build inside
            assert drafter.sizing_kv_cache
            rebuild()
            return 2**30  # VLLM_CPU_KVCACHE_SPACE=1 in tests/conftest.py

        calls.clear()
        kv_reservation._make_wrapper(sizing)(types.SimpleNamespace(model_runner=runner))
        assert calls == []
        assert not drafter.sizing_kv_cache
        rebuild()  # the real build, after the sizing
        assert calls == ["_compile_sampling", "_compile_scoring", "_build_selection_graphs",
                         "compile_when_bound"]
    finally:
        free_llm(llm)


def test_plugin_chosen_cpu_kv_size_leaves_room_for_the_reservation():
    """When the plugin sizes the CPU KV cache itself (patches/cpu_defaults.py), it adds what
    TriForce will reserve, so the KV that remains still holds the size it chose."""
    plan = smollm2_plan(max_num_seqs=1)
    wanted = 2128 * 46_080  # one 2,128-token request of SmolLM2 float32
    assert plan.kv_budget(plan.available_for(wanted)) >= wanted
    assert plan.kv_budget(wanted) < wanted  # without it, one request no longer fits
