"""The engine settings TriForce needs, decided while vLLM's config can still change.

vLLM 0.32.0 on CUDA defaults to settings TriForce cannot run under (read from vLLM's own
source; CPU forces most of them off, which is why CPU tests never saw them):

| setting | CUDA default | why TriForce breaks | what we do |
|---|---|---|---|
| `cudagraph_mode` | FULL_AND_PIECEWISE | a FULL graph replays attention without Python, so the capture hook (engine/device/capture.py) sees no query/key: summaries miss committed keys and selections never refresh | default PIECEWISE (attention stays an eager custom op, vllm/model_executor/layers/attention/attention.py); refuse FULL, FULL_AND_PIECEWISE, FULL_DECODE_ONLY, except an explicit FULL_AND_PIECEWISE on Model Runner V2 (experimental: FULL only for passes TriForce reads nothing of, engine/mrv2/graphs.py) |
| async scheduling | on for `draft_model` (vllm/config/vllm.py ~1585) | the V1 proposer reads token ids that are still -1 placeholders | default off; refuse an explicit on, except on Model Runner V2 (experimental: MRV2's runner cuts the K drafts async scheduling schedules to each request's depth, engine/mrv2/draft_tokens.py) |
| model runner | V2 unless `VLLM_USE_V2_MODEL_RUNNER=0` | the TriForce proposer lives in the V1 runner; V2 would silently run its own draft-model speculator | set 0; refuse the features that force V2 (watermarking, HiSparse); with `VLLM_TRIFORCE_MRV2=1` or an explicit `VLLM_USE_V2_MODEL_RUNNER=1` (experimental, GPUs only; refused on CPU) set 1 and TriForce's own MRV2 worker (engine/mrv2/) |
| data parallelism | 1 | ranks run different numbers of middle passes; MoE DP collectives then hang (vllm/forward_context.py ~299) | refuse `data_parallel_size > 1` |
| attention backend | FLASH_ATTN (Hopper), FLASHINFER (Blackwell) | per-layer metadata must not share builder state | refuse backends outside `SUPPORTED_ATTENTION_BACKENDS` |
| prompt embeddings | off | vLLM's draft-model path reads the id of a request's last prompt token when its prefill ends (vllm/v1/spec_decode/llm_base_proposer.py `prepare_next_token_ids_padded`); a prompt given as embeddings has none, and the step fails (vLLM's own `draft_model` too) | refuse `enable_prompt_embeds` |
| LoRA | off | vLLM's LoRA layers map adapters to the tokens of vLLM's own batch (the punica wrapper's metadata, set per step by the runner); TriForce's passes have other tokens, and without their own mapping the first one fails with a shape error mid-generation | map each pass's tokens to their requests' adapters (engine/adapters.py, V1 runner); refuse `enable_lora` on Model Runner V2 |
| attention kinds | the model's | chunked, linear or Mamba layers sit in KV-cache groups of their own, a sliding window in every layer frees the blocks behind it, and MLA caches a latent per token; TriForce selects blocks of per-head keys for full-attention layers | take local layers beside full ones in the target (two levels, V1 runner: each pass runs them over their own group, engine/device/forward.py `WindowLayers`); refuse the rest from the model's config (`check_models`), before weights load |
| M-RoPE | the model's | vLLM refuses a draft model with M-RoPE, and with two levels TriForce's draft model is the target | take it (patches/mrope_draft.py): TriForce's passes give the target its positions; refuse a small draft with M-RoPE, and M-RoPE on Model Runner V2 |

`decide(engine_args, parallel_config)` runs inside `EngineArgs.create_speculative_config`
(patches/spec_config.py), i.e. before `VllmConfig` is built and before any weights load; it
changes only settings the user left at vLLM's default; `check_models` reads the target's and
the draft's configs once vLLM has built them. `check_effective(vllm_config)` runs
when the proposer is built (still before weights load) and refuses a config in which vLLM
itself re-enabled something unsafe; `describe(vllm_config)` is the start-up log line.
"""

from __future__ import annotations

import os

from vllm_triforce.config import (SUPPORTED_ATTENTION_BACKENDS, TriForceConfigError,
                                  triforce_settings)

UNSAFE_CUDAGRAPH_MODES = ("FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# Experimental, off by default: TriForce on Model Runner V2 (engine/mrv2/), GPUs only,
# until a GPU run shows it exact; it then becomes the GPU default.
MRV2_SWITCH_ENV = "VLLM_TRIFORCE_MRV2"
MRV2_WORKER = "vllm_triforce.engine.mrv2.speculator.TriForceWorker"
# the one FULL mode TriForce takes, explicitly and on Model Runner V2 only: a pass it reads
# runs piecewise, every other decode pass as one graph (engine/mrv2/graphs.py)
MRV2_FULL_MODE = "FULL_AND_PIECEWISE"


def mrv2_requested() -> bool:
    """The experimental Model Runner V2 binding was asked for: TriForce's switch
    `VLLM_TRIFORCE_MRV2=1`, or vLLM's own `VLLM_USE_V2_MODEL_RUNNER=1` set explicitly (a
    user who names vLLM's V2 runner gets TriForce on it, not an error)."""
    return _env_on(MRV2_SWITCH_ENV) or _env_on(V2_RUNNER_ENV)


def _mrv2_asked_by() -> str:
    """The variable that asked for Model Runner V2 (set to 1): TriForce's switch first."""
    return MRV2_SWITCH_ENV if _env_on(MRV2_SWITCH_ENV) else V2_RUNNER_ENV


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def decide(engine_args, parallel_config) -> list[str]:
    """Refuse unsafe explicit settings, then set the safe defaults on `engine_args`.
    Returns the names of the settings TriForce chose (for the start-up log)."""
    _check_cudagraph_mode(engine_args.compilation_config.cudagraph_mode)
    _check_async_scheduling(engine_args.async_scheduling)
    _check_v2_runner(engine_args)
    _check_data_parallel(parallel_config.data_parallel_size)
    _check_lora(bool(getattr(engine_args, "enable_lora", False)))
    _check_prompt_embeds(bool(getattr(engine_args, "enable_prompt_embeds", False)))
    check_attention_backend(_requested_backend(engine_args))
    forced = []
    if engine_args.compilation_config.cudagraph_mode is None:
        from vllm.config.compilation import CUDAGraphMode

        engine_args.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        forced.append("cudagraph_mode")
    if engine_args.async_scheduling is None:
        engine_args.async_scheduling = False
        forced.append("async_scheduling")
    if mrv2_requested():
        os.environ[V2_RUNNER_ENV] = "1"
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = MRV2_WORKER
        forced.append("model_runner")
    elif V2_RUNNER_ENV not in os.environ:
        os.environ[V2_RUNNER_ENV] = "0"
        forced.append("model_runner")
    return forced


def mrv2_keys(passthrough: dict) -> dict:
    """The draft-model keys, with draft_sample_method "probabilistic" under
    `VLLM_TRIFORCE_MRV2=1`: Model Runner V2 then keeps the `draft_logits` its verifier reads
    a sampled draft's distribution from (engine/mrv2/draft_logits.py)."""
    if not mrv2_requested():
        return dict(passthrough)
    return {**passthrough, "draft_sample_method": "probabilistic"}


def draft_backend(engine_args, passthrough: dict) -> dict:
    """The draft-model keys with the target's requested attention backend for the small
    draft too, unless the user chose one for it: vLLM picks a draft's backend on its own
    (vllm/v1/spec_decode/llm_base_proposer.py `_create_draft_vllm_config`), and draft
    and target layers share one KV-cache group, so their layouts must agree."""
    requested = _requested_backend(engine_args)
    if requested is None or "attention_backend" in passthrough:
        return dict(passthrough)
    return {**passthrough, "attention_backend": requested}


def check_effective(vllm_config) -> None:
    """The built config must still be safe (vLLM may rewrite cudagraph_mode on its own)."""
    _check_cudagraph_mode(vllm_config.compilation_config.cudagraph_mode,
                          "vLLM resolved cudagraph_mode to {mode} for this model")
    _check_async_scheduling(vllm_config.scheduler_config.async_scheduling)
    _check_data_parallel(vllm_config.parallel_config.data_parallel_size)
    _check_lora(vllm_config.lora_config is not None)
    _check_prompt_embeds(bool(vllm_config.model_config.enable_prompt_embeds))
    settings = triforce_settings(vllm_config) or {}
    check_models(vllm_config.model_config, vllm_config.speculative_config.draft_model_config,
                 has_draft=settings.get("model") is not None)


def describe(vllm_config, backend_name: str, forced: list[str]) -> str:
    """One line with the effective choices, for the start-up log."""
    def tag(setting):
        return " (forced)" if setting in forced else ""

    mode = vllm_config.compilation_config.cudagraph_mode
    why = " (enforce_eager)" if vllm_config.model_config.enforce_eager else tag("cudagraph_mode")
    async_on = vllm_config.scheduler_config.async_scheduling
    runner = (f"Model Runner V2 ({_mrv2_asked_by()}=1, experimental)" if mrv2_requested()
              else f"V1 model runner{tag('model_runner')}")
    return (f"TriForce: cudagraph_mode={getattr(mode, 'name', mode)}{why}, async scheduling "
            f"{'on' if async_on else 'off'}{tag('async_scheduling')}, {runner}, "
            f"attention backend {backend_name}")


def _fix(setting: str, why: str, fix: str) -> TriForceConfigError:
    return TriForceConfigError(f"TriForce cannot run with {setting}: {why}. Fix: {fix}.")


def _check_cudagraph_mode(mode, setting: str = "cudagraph_mode={mode}") -> None:
    name = getattr(mode, "name", mode)
    if name == MRV2_FULL_MODE and mrv2_requested():
        return  # FULL graphs for the passes TriForce reads nothing of (engine/mrv2/graphs.py)
    if name in UNSAFE_CUDAGRAPH_MODES:
        raise _fix(setting.format(mode=name),
                   "full CUDA graphs replay attention without running Python, so TriForce "
                   "never sees the keys it scores blocks with",
                   "use compilation_config={'cudagraph_mode': 'PIECEWISE'} "
                   "(-cc.cudagraph_mode=PIECEWISE), or leave it unset (TriForce then picks "
                   "PIECEWISE), or --enforce-eager; on a GPU with "
                   f"{MRV2_SWITCH_ENV}=1 (experimental), {MRV2_FULL_MODE} is taken")


def _check_async_scheduling(async_scheduling) -> None:
    if async_scheduling and not mrv2_requested():
        raise _fix("async_scheduling=True",
                   "the V1 runner's proposer reads sampled token ids that async scheduling "
                   "leaves as placeholders",
                   "drop --async-scheduling (TriForce turns it off by default); on a GPU, "
                   f"{MRV2_SWITCH_ENV}=1 (experimental) runs TriForce on Model Runner V2, "
                   "which takes it")


def _check_v2_runner(engine_args) -> None:
    if mrv2_requested():
        _check_mrv2_switch(engine_args)
    if getattr(engine_args, "watermark_config", None) is not None:
        raise _fix("watermark_config", "watermarking forces vLLM's V2 model runner and "
                   "marks drafts inside vLLM's own speculator, which TriForce replaces",
                   "drop the watermark config")
    attention_config = getattr(engine_args, "attention_config", None)
    if getattr(attention_config, "hisparse_config", None) is not None:
        raise _fix("attention_config.hisparse_config", "HiSparse forces vLLM's V2 model "
                   "runner and sparsifies the attention TriForce's per-layer block tables "
                   "run through", "drop hisparse_config")


def _check_mrv2_switch(engine_args) -> None:
    """Model Runner V2 asked for (`VLLM_TRIFORCE_MRV2=1` or `VLLM_USE_V2_MODEL_RUNNER=1`)
    on a machine or with settings it cannot run on."""
    from vllm.platforms import current_platform

    asked = _mrv2_asked_by()
    if not current_platform.is_cuda():
        raise _fix(f"{asked}=1 on {current_platform.device_name}",
                   "Model Runner V2 runs Triton kernels every step, and this platform has no "
                   "Triton backend (vLLM itself uses the V1 runner here)",
                   f"unset {asked}: TriForce runs in the V1 runner")
    if os.environ.get(V2_RUNNER_ENV, "").strip().lower() in ("0", "false"):
        raise _fix(f"{MRV2_SWITCH_ENV}=1 with {V2_RUNNER_ENV}=0",
                   "the one asks for Model Runner V2, the other for the V1 runner",
                   "unset one of them")
    if engine_args.worker_cls not in ("auto", MRV2_WORKER):
        raise _fix(f"{asked}=1 with worker_cls={engine_args.worker_cls}",
                   "TriForce's Model Runner V2 binding is its own worker class",
                   "leave worker_cls unset")


def _check_data_parallel(data_parallel_size: int) -> None:
    if data_parallel_size > 1:
        raise _fix(f"data_parallel_size={data_parallel_size}",
                   "data-parallel ranks would run different numbers of middle-level passes, "
                   "and vLLM's cross-rank batch coordination would hang",
                   "run one server per replica behind a load balancer, with "
                   "data_parallel_size=1 (tensor parallelism is supported)")


def _check_lora(enabled: bool) -> None:
    """LoRA adapters run on TriForce's passes in the V1 runner (engine/adapters.py); the
    Model Runner V2 binding does not map them."""
    if enabled and mrv2_requested():
        asked = _mrv2_asked_by()
        raise _fix(f"enable_lora=True with {asked}=1",
                   "TriForce's Model Runner V2 binding does not map LoRA adapters to its "
                   "passes' tokens",
                   f"unset {asked}: TriForce runs LoRA adapters in the V1 runner")


def _check_prompt_embeds(enabled: bool) -> None:
    if enabled:
        raise _fix("enable_prompt_embeds=True",
                   "vLLM's draft-model path, which TriForce runs in, reads the id of each "
                   "request's last prompt token, and a prompt given as embeddings has none "
                   "(the step fails in prepare_next_token_ids_padded, as it does for vLLM's "
                   "own draft_model method)",
                   "send prompts as text or token ids, or serve prompt embeddings without "
                   "--speculative-config")


def check_models(target, draft, has_draft: bool) -> None:
    """The target's and the small draft's (`has_draft`: three levels) attention, from their
    configs: `check_attention` for each, then `check_windows` and `check_mrope`. `target`,
    `draft`: vLLM's `ModelConfig`s (draft: the speculative config's `draft_model_config`,
    the target's own with two levels). Called when vLLM builds the speculative config
    (patches/spec_config.py), before any weights load, and again by `check_effective`."""
    small_draft = draft if has_draft else None
    check_attention(target, "the target", target.max_model_len, windows=True)
    if small_draft is not None:
        check_attention(small_draft, "the small draft", target.max_model_len, windows=False)
    check_windows(target, small_draft)
    check_mrope(target, small_draft)


# `layer_types` entries of a layer with full attention over every cached token
FULL_ATTENTION_LAYER_TYPES = ("full_attention", "attention")
# ... of a layer attending locally: to a sliding window of the newest tokens (Gemma 2 and 3,
# gpt-oss), or within its chunk of the context (Llama 4)
LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def layer_kinds(model_config) -> list[str]:
    """The model's `layer_types` (one entry per layer), [] where its config has none."""
    return list(getattr(model_config.hf_text_config, "layer_types", None) or [])


def has_window_layers(model_config) -> bool:
    """Some layers attend locally (a sliding window, a chunk) beside full-attention ones
    (`layer_types`)."""
    return any(kind in LOCAL_LAYER_TYPES for kind in layer_kinds(model_config))


def full_attention_layers(model_config, num_layers: int) -> int:
    """How many of the model's `num_layers` layers attend over the whole context: the
    layers TriForce selects blocks for (the others, local layers, run over their
    own window in every pass, engine/device/forward.py `WindowLayers`)."""
    kinds = layer_kinds(model_config)
    if len(kinds) != num_layers:
        return num_layers
    return sum(kind in FULL_ATTENTION_LAYER_TYPES for kind in kinds)


def check_attention(model_config, which: str, max_model_len: int, windows: bool) -> None:
    """Every layer of `model_config`'s model attends over its whole context (of up to
    `max_model_len` tokens) with standard per-head keys, or, where `windows` (the target),
    locally beside layers that do (a sliding window: Gemma 2 and 3, gpt-oss; chunks: Llama
    4): TriForce selects
    blocks for the full-attention layers (engine/drafting.py checks the KV-cache groups
    vLLM made). What a config says before any weights load: layers of other kinds
    (`layer_types`: linear; local ones in a small draft, or with no full layer beside
    them), a sliding window shorter than the context in every layer (vLLM's rule for
    `CacheConfig.sliding_window`: a `sliding_window` without `layer_types`; Mistral 7B
    v0.1), chunked attention with no `layer_types` to say which layers, Mamba or
    linear-attention layers, latent attention (MLA: DeepSeek and its kind)."""
    text = model_config.hf_text_config
    kinds = layer_kinds(model_config)
    taken = FULL_ATTENTION_LAYER_TYPES + (LOCAL_LAYER_TYPES if windows else ())
    full = [kind for kind in kinds if kind in FULL_ATTENTION_LAYER_TYPES]
    window = model_config.get_sliding_window()
    why = None
    others = [kind for kind in kinds if kind not in taken]
    if others or (kinds and not full):
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
        why = (f"none of its layers has full attention ({counts})" if not others
               else f"it has layers of a kind TriForce cannot select blocks for ({counts})"
               if windows else f"not all its layers have full attention ({counts})")
    elif len(full) == len(kinds) and window is not None and window < max_model_len:
        why = (f"every layer attends to the last {window} tokens "
               f"of a context of up to {max_model_len}, and vLLM frees the blocks behind "
               "that window")
    elif len(full) == len(kinds) and getattr(text, "attention_chunk_size", None):
        why = f"it attends in chunks of {text.attention_chunk_size} tokens in some layers"
    elif model_config.is_hybrid:
        why = "it has Mamba or linear-attention layers beside its attention layers"
    elif model_config.use_mla:
        why = ("its attention is multi-head latent attention (MLA), whose cache holds a "
               "latent per token, not the per-head keys TriForce summarises")
    if why is not None:
        raise _fix(f"{which} {model_config.model}",
                   f"{why}; TriForce selects KV blocks for layers that each attend over the "
                   "whole context with per-head keys"
                   + (", beside which a target may have local layers" if windows
                      else ""),
                   "serve this model without --speculative-config" if which == "the target"
                   else "draft with a model that has full attention in every layer, or leave "
                   "speculative_config's 'model' unset (two levels)")


def check_windows(target, small_draft) -> None:
    """A target with local layers (sliding-window or chunked: Gemma 2 and 3, gpt-oss,
    Llama 4) runs with two levels
    in the V1 runner: its middle passes run those layers over their own KV-cache group
    (engine/device/forward.py `WindowLayers`). A small draft beside it (three levels),
    whose layers vLLM would group with the target's, and the Model Runner V2 binding,
    which builds one table for every layer, are refused. Both are vLLM's `ModelConfig`s."""
    if not has_window_layers(target):
        return
    if small_draft is not None:
        raise _fix(f"a small draft model ({small_draft.model}) beside a target with "
                   f"local layers ({target.model})",
                   "TriForce runs such a target with two levels: its three-level engine "
                   "expects the target's and the draft's layers in one KV-cache group, and "
                   "vLLM gives local (sliding-window or chunked) layers groups of their own",
                   "leave speculative_config's 'model' unset (two levels: the target drafts "
                   "for itself over its retrieval cache)")
    if mrv2_requested():
        asked = _mrv2_asked_by()
        raise _fix(f"{asked}=1 for a model with local layers ({target.model})",
                   "TriForce's Model Runner V2 binding gives every layer one block table",
                   f"unset {asked}: TriForce runs such models in the V1 runner")


def check_mrope(target, small_draft) -> None:
    """M-RoPE (Qwen2-VL, Qwen2.5-VL, PaddleOCR-VL and their kind): the target's middle
    passes get its positions in the V1 runner (engine/device/forward.rotary_positions); a
    small draft (three levels; None with two) with M-RoPE, or the target's in Model Runner
    V2, would rotate with 1-D positions. Both are vLLM's `ModelConfig`s."""
    if small_draft is not None and small_draft.uses_mrope:
        raise _fix(f"a small draft model with M-RoPE ({small_draft.model})",
                   "its StreamingLLM passes rotate generated tokens with 1-D positions, "
                   "rebased to its window",
                   "draft with a text-only model of the target's vocabulary, or leave "
                   "speculative_config's 'model' unset (two levels: the target drafts for "
                   "itself over its retrieval cache)")
    if target.uses_mrope and mrv2_requested():
        asked = _mrv2_asked_by()
        raise _fix(f"{asked}=1 for a model with M-RoPE ({target.model})",
                   "TriForce's Model Runner V2 binding gives its passes 1-D positions",
                   f"unset {asked}: TriForce runs M-RoPE models in the V1 runner")


def _requested_backend(engine_args) -> str | None:
    backend = engine_args.attention_backend
    if backend is None:
        backend = getattr(engine_args.attention_config, "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


def check_attention_backend(name: str | None) -> None:
    """Refuse a backend outside the allow-list: at config time for the requested backend,
    and again when the attention backend is built (engine/device/forward.py `metadata_path`)."""
    if name is not None and name not in SUPPORTED_ATTENTION_BACKENDS:
        raise _fix(f"attention backend {name}",
                   "TriForce builds attention metadata per layer and supports only backends "
                   "whose metadata it handles correctly",
                   f"choose one of {', '.join(SUPPORTED_ATTENTION_BACKENDS)} with "
                   "--attention-backend, or leave it unset")
