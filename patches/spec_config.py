"""`"method": "triforce"` wherever vLLM accepts a speculative config.

Why a patch: vLLM 0.32's `SpeculativeConfig.method` is a pydantic `Literal` validated at
construction (`SpeculativeMethod`, vllm/config/speculative.py): `"triforce"` raises a
ValidationError, and no plugin API can add a method name. Every entry
point (`LLM(...)`, `vllm serve`, `AsyncLLM`) builds the config through
`EngineArgs.create_speculative_config` (vllm/engine/arg_utils.py, 0.32.0), so wrapping that
one method covers them all.

What the wrapper does for a triforce config, before any weights load:
1. validates the TriForce keys (`TriForceConfig`; clear errors naming the key),
2. refuses pipeline parallelism (the middle level needs every target layer on one rank),
3. hands vLLM a plain `draft_model` config (the draft, or the target itself for two-level
   TriForce: its weights are then never loaded twice, see engine/proposer.py) and carries the
   TriForce settings to the workers in `additional_config["triforce"]`,
4. checks the draft's vocabulary against the target's, and refuses models with attention
   TriForce cannot select blocks for (local layers are taken beside full ones in
   a two-level target) and a small draft with M-RoPE (engine_settings.check_models),
5. lifts the draft's `max_model_len` to the target's: the small draft only ever sees
   StreamingLLM-rebased positions (core/streaming.py), so its short trained context must
   not cap the target's context nor stop drafting past it.
6. decides the engine settings TriForce needs while they can still change
   (vllm_triforce/engine_settings.py: PIECEWISE CUDA graphs, async scheduling off, the V1
   model runner) and refuses explicit settings that break it, naming each and its fix.
"""

from vllm_triforce.patches import _util

NAME = "spec_config"
TARGET = ("vllm.engine.arg_utils", "EngineArgs.create_speculative_config")


def apply() -> None:
    _util.wrap(*TARGET, _make_wrapper, NAME)


def _make_wrapper(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") == "triforce"):
            return original(self, target_model_config, target_parallel_config)
        from vllm_triforce import engine_settings
        from vllm_triforce.config import TriForceConfig, with_settings

        cfg = TriForceConfig.from_speculative_config(_with_resolved_asset(spec))
        _check_parallel(target_parallel_config)
        forced = engine_settings.decide(self, target_parallel_config)
        passthrough = engine_settings.mrv2_keys(
            engine_settings.draft_backend(self, cfg.passthrough))
        self.speculative_config = {
            "method": "draft_model",
            "model": cfg.model or target_model_config.model,
            "num_speculative_tokens": cfg.num_speculative_tokens,
            **passthrough,
        }
        self.additional_config = with_settings(self.additional_config, cfg, forced)
        _check_vocab(cfg, _draft_vocab_size(cfg, target_model_config), target_model_config)
        try:
            result = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = spec
        _check_vocab(cfg, result.draft_model_config.get_vocab_size(), target_model_config)
        engine_settings.check_models(target_model_config, result.draft_model_config,
                                     has_draft=cfg.model is not None)
        result.draft_model_config.max_model_len = target_model_config.max_model_len
        return result

    return create_speculative_config


ASSET_PREFIX = "vllm-triforce:"


def _with_resolved_asset(spec: dict) -> dict:
    """`"model": "vllm-triforce:NAME"` names a model `vllm-triforce models fetch` prepares
    (fetched and converted on first use), so example configs run as written. Resolved in
    the user's dict, so the validated config is final as built."""
    model = spec.get("model")
    if not (isinstance(model, str) and model.startswith(ASSET_PREFIX)):
        return spec
    from vllm_triforce.assets import ensure_model

    return {**spec, "model": str(ensure_model(model[len(ASSET_PREFIX):]))}


def _check_parallel(parallel_config) -> None:
    from vllm_triforce.config import TriForceConfigError

    if parallel_config.pipeline_parallel_size > 1:
        raise TriForceConfigError(
            f"pipeline_parallel_size={parallel_config.pipeline_parallel_size}: TriForce's middle "
            "level runs every target layer inside the proposer, which lives on the last pipeline "
            "rank only. Use tensor parallelism (pipeline_parallel_size=1) with method 'triforce'.")
    # Context parallelism spreads each request's KV blocks over ranks in a virtual block
    # layout (vllm/v1/worker/block_table.py, 0.32.0); TriForce's compacted per-layer tables
    # index the local layout, so the middle and draft levels would read the wrong blocks.
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel_config, setting)
        if size > 1:
            raise TriForceConfigError(
                f"TriForce cannot run with {setting}={size}: context parallelism shards each "
                "request's KV cache across ranks, and TriForce's retrieval tables index one "
                f"rank's blocks only. Fix: leave {setting}=1 (use tensor parallelism instead).")


def _draft_vocab_size(cfg, target_model_config) -> int | None:
    """The draft's vocabulary from its config, read before vLLM's own (less clear) check."""
    if cfg.model is None:
        return None
    from vllm.transformers_utils.config import get_config

    try:
        hf_config = get_config(cfg.model, trust_remote_code=target_model_config.trust_remote_code)
    except Exception:  # unreadable here: vLLM's SpeculativeConfig will report it
        return None
    return getattr(hf_config.get_text_config(), "vocab_size", None)


def _check_vocab(cfg, draft_vocab, target_model_config) -> None:
    from vllm_triforce.config import TriForceConfigError

    if cfg.model is None or draft_vocab is None:
        return
    target_vocab = target_model_config.get_vocab_size()
    if draft_vocab != target_vocab:
        raise TriForceConfigError(
            f"speculative_config['model']={cfg.model!r} has a vocabulary of {draft_vocab} tokens "
            f"but the target has {target_vocab}. TriForce's levels share token ids: use a draft "
            "with the target's tokenizer, or leave 'model' out for two-level TriForce.")
