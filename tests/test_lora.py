"""LoRA adapters (`--enable-lora`) with TriForce. vLLM maps each token of its own batch to
its request's adapter once a step; TriForce's middle passes run other tokens, so each pass
maps its own tokens to their requests' adapters (engine/adapters.py). Here a tiny Llama,
two random adapters and a batch that mixes them with a request that has none: greedy
outputs must equal plain vLLM's (with the same adapters) with drafts verified, for two and
three levels (the small draft drafts without adapters; the middle level, with them,
verifies its drafts).
"""

import pytest

import tiny_models
from engine_helpers import assert_drafted, fixed_depth_spec, greedy_run, make_engine_kwargs

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
PROMPT_WORDS = (900, 700, 1100, 500)
ADAPTERS = ("a1", None, "a2", "a1")  # each prompt's adapter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the base model, adapter name -> its folder, a small draft)."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_models.build_tiny_llama(root / "base")
    adapters = {name: tiny_models.build_tiny_lora(root / name, base, seed=seed)
                for seed, name in enumerate(("a1", "a2"), start=1)}
    return base, adapters, tiny_models.build_tiny_llama_draft(root / "draft")


def generate(models, spec, adapters: bool = True):
    """(greedy tokens, TriForce's counters), each prompt with its adapter (`adapters`)."""
    from vllm.lora.request import LoRARequest

    base, folders, _ = models
    ids = {name: i for i, name in enumerate(sorted(folders), start=1)}
    requests = [None if name is None or not adapters
                else LoRARequest(name, ids[name], str(folders[name])) for name in ADAPTERS]
    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
    engine = make_engine_kwargs(max_model_len=2048, enable_lora=True, max_lora_rank=8,
                                max_loras=2)
    return greedy_run(base, spec, prompts, MAX_TOKENS, engine, lora_request=requests)[:2]


@pytest.fixture(scope="module")
def plain_tokens(models):
    tokens = generate(models, None)[0]
    without = generate(models, None, adapters=False)[0]
    assert tokens[0] != without[0] and tokens[2] != without[2], "the adapters change nothing"
    return tokens


def test_middle_level_equals_the_target_where_it_holds_every_block(models, plain_tokens):
    """A retrieval budget past every context: the middle level is the target with each
    request's adapter, so every draft is accepted, only if each pass maps its tokens to
    their requests' adapters. Mapping every pass to no adapter: 0 of 624 accepted; leaving
    vLLM's own batch mapping: the first pass fails in the LoRA layers."""
    tokens, stats = generate(models, fixed_depth_spec(budget=2048))
    assert tokens == plain_tokens
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"], stats


@pytest.mark.parametrize("levels", [2, 3])
def test_retrieval_with_adapters_is_lossless(models, plain_tokens, levels):
    """A budget of 1,024 tokens against contexts of about 1,000 to 2,000."""
    draft = models[2] if levels == 3 else None
    tokens, stats = generate(models, fixed_depth_spec(budget=1024, draft=draft))
    assert tokens == plain_tokens
    assert_drafted(stats, levels=levels)
