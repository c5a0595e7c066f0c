"""vLLM's refusal of a draft model with M-RoPE, lifted for TriForce.

Upstream (vLLM 0.32.0 and 0.33.0, `v1/spec_decode/llm_base_proposer.py`,
`SpecDecodeBaseProposer.__init__`): a draft-model proposer calls `_raise_if_mrope()`,
which raises `NotImplementedError` where its `draft_model_config` uses M-RoPE (Qwen2-VL,
Qwen2.5-VL, PaddleOCR-VL and their kind): vLLM's draft-model passes give the draft 1-D
positions. The V1 runner builds that proposer before TriForce's replaces it
(patches/runner.py), and with two levels TriForce's "draft model" is the target itself,
so a TriForce engine over such a target failed at start-up with that error.

How: wrap `_raise_if_mrope`; for a TriForce engine it returns. TriForce's middle passes
give an M-RoPE target its positions (engine/device/forward.py `rotary_positions`, each
generated token shifted by its request's `mrope_position_delta`), and a small draft with
M-RoPE, which TriForce's StreamingLLM passes would rotate with 1-D positions, is refused
with the fix when vLLM builds the speculative config (engine_settings.py `check_models`),
before any weights load. Any other engine: vLLM's check, unchanged.

Gate: TriForce settings in `additional_config`. Upstream: none known. Remove: when vLLM's
draft-model path gives M-RoPE drafts their positions, or a plugin can register a proposer
(RFC vllm#36219) that vLLM does not first build as a draft-model one.
"""

from vllm_triforce.patches import _util

NAME = "mrope_draft"
TARGET = ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._raise_if_mrope")


def apply() -> None:
    _util.wrap(*TARGET, _make_raise_if_mrope, NAME)


def _make_raise_if_mrope(original):
    def _raise_if_mrope(self):
        from vllm_triforce.config import triforce_settings

        if triforce_settings(self.vllm_config) is not None:
            return None
        return original(self)

    return _raise_if_mrope
