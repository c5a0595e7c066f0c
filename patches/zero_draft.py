"""A step in which no request carries drafts runs vLLM's plain sampling path.

Upstream (vLLM 0.32.0, `v1/worker/gpu_model_runner.py`, `GPUModelRunner._prepare_inputs`):
with a speculative config, every step takes the speculative branch (`use_spec_decode =
self.speculative_config is not None`): it builds `SpecDecodeMetadata` from the scheduled
drafts and `_sample` then runs the rejection sampler, even when the scheduler handed out no
draft at all (`scheduler_output.scheduled_spec_decode_tokens` is empty: the scheduler adds
a request there only when its `spec_token_ids` is non-empty). TriForce's depth controller
hands vLLM `[]` for every request it keeps plain, so such steps are common, and on them the
speculative branch costs more than plain vLLM's step (the rejection sampler and the
speculative `_prepare_inputs` do more than their plain counterparts) for nothing: with zero
drafts the rejection sampler only samples the bonus token, which is what the plain sampler
does.

How: wrap `_prepare_inputs`; when the runner's drafter asks for it
(`PLAIN_STEPS_WITHOUT_DRAFTS`, TriForce's proposer) and no draft is scheduled, the wrapped
call sees `speculative_config = None` (restored before it returns), so vLLM itself takes
its non-speculative branch: `spec_decode_metadata` is None, one logits row per request, the
plain `Sampler`. Nothing else in `_prepare_inputs` reads `speculative_config` (0.32.0). The
rest of the step already handles a None `spec_decode_metadata` with a speculative config
(`propose_draft_token_ids`: the drafter gets the pass's own tokens, no rejected counts;
engine/batch.py reads them as zero rejections).

Why not for recurrent models: vLLM keeps zero-draft decode rows on the speculative path for
their state offsets (the `zero_draft_decode_mask` comment there); TriForce refuses Mamba
and linear-attention layers (engine_settings.check_attention), so every model it runs
keeps a KV cache only, of full-attention layers and, beside them, local ones.

Gate: the drafter's `PLAIN_STEPS_WITHOUT_DRAFTS` and an empty `scheduled_spec_decode_tokens`
(with async scheduling the scheduler schedules placeholder drafts, so nothing changes there).
Upstream: none known. Remove when vLLM skips speculative sampling for a step without drafts.
"""

from vllm_triforce.patches import _util

NAME = "zero_draft"
TARGET = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs")


def apply() -> None:
    _util.wrap(*TARGET, _make_prepare_inputs, NAME)


def _make_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if (not getattr(drafter, "PLAIN_STEPS_WITHOUT_DRAFTS", False)
                or scheduler_output.scheduled_spec_decode_tokens):
            return original(self, scheduler_output, *args, **kwargs)
        speculative_config, self.speculative_config = self.speculative_config, None
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = speculative_config

    return _prepare_inputs
