"""Requests with `min_p` or `logit_bias` are served by a TriForce engine, at depth 0.

Upstream (vLLM 0.32.0 and 0.33.0):
- `SamplingParams._validate_spec_decode` (vllm/sampling_params.py) refuses `min_p > 0` and
  any `logit_bias` whenever a speculative config exists ("not yet supported with
  speculative decoding");
- `build_logitsprocs` (vllm/v1/sample/logits_processor/__init__.py), which the runner
  calls through its own module (`gpu_model_runner.build_logitsprocs`), then builds only
  the min-tokens processor, so the min-p and logit-bias processors do not exist.

Why vLLM refuses: its rejection sampler applies neither to the rows of drafted positions
(`RejectionSampler.apply_logits_processors` runs only the min-tokens processor there, and
`apply_sampling_constraints` only temperature, top-k and top-p). The one row every request
has, the bonus row, is sampled by vLLM's plain `Sampler`, which applies every logits
processor. A request handed no draft has only that row, so its tokens are plain vLLM's:
TriForce's proposer gives such requests depth 0 every step (engine/depth.decodes_plainly),
and the rest of the batch still drafts.

How:
- wrap `InputProcessor._validate_params` (the front end's check of each request): for a
  TriForce engine (`additional_config["triforce"]`), the call runs with a context flag
  under which the wrapped `SamplingParams._validate_spec_decode` lets `min_p` and
  `logit_bias` through; every other check, and every other engine, is unchanged;
- wrap `gpu_model_runner.build_logitsprocs`: for a TriForce engine without custom logits
  processors, vLLM builds its built-in processors as for plain decoding (the speculative
  config hidden for that call). Custom logits processors stay refused: vLLM's per-request
  activation is opaque to the proposer, so it could not keep their requests plain.

Gate: TriForce settings in `additional_config`. Upstream: the refusal's "not yet"; none
known. Remove when vLLM's rejection sampler applies min_p and logit_bias to drafted rows
(the depth-0 rule in engine/depth.py can go with it).
"""

import contextvars

from vllm_triforce.patches import _util

NAME = "plain_params"
VALIDATE_PARAMS = ("vllm.v1.engine.input_processor", "InputProcessor._validate_params")
VALIDATE_SPEC = ("vllm.sampling_params", "SamplingParams._validate_spec_decode")
BUILD_LOGITSPROCS = ("vllm.v1.worker.gpu_model_runner", "build_logitsprocs")

# Set while a TriForce engine's front end checks one request.
_TRIFORCE_REQUEST = contextvars.ContextVar("vllm_triforce_request", default=False)


def apply() -> None:
    _util.wrap(*VALIDATE_PARAMS, _make_validate_params, NAME)
    _util.wrap(*VALIDATE_SPEC, _make_validate_spec_decode, NAME)
    _util.wrap(*BUILD_LOGITSPROCS, _make_build_logitsprocs, NAME)


def _is_triforce(vllm_config) -> bool:
    from vllm_triforce.config import triforce_settings

    return triforce_settings(vllm_config) is not None


def _make_validate_params(original):
    def _validate_params(self, *args, **kwargs):
        if not _is_triforce(self.vllm_config):
            return original(self, *args, **kwargs)
        token = _TRIFORCE_REQUEST.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _TRIFORCE_REQUEST.reset(token)

    return _validate_params


def _make_validate_spec_decode(original):
    def _validate_spec_decode(self, speculative_config):
        if _TRIFORCE_REQUEST.get():
            return None  # served at depth 0 (module docstring)
        return original(self, speculative_config)

    return _validate_spec_decode


def _make_build_logitsprocs(original):
    def build_logitsprocs(vllm_config, *args, **kwargs):
        custom = kwargs.get("custom_logitsprocs", args[3] if len(args) > 3 else ())
        if custom or not _is_triforce(vllm_config) or vllm_config.speculative_config is None:
            return original(vllm_config, *args, **kwargs)
        speculative_config = vllm_config.speculative_config
        object.__setattr__(vllm_config, "speculative_config", None)
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            object.__setattr__(vllm_config, "speculative_config", speculative_config)

    return build_logitsprocs
