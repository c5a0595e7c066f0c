"""Models for `vllm-triforce bench gpu`, built on the spot: no weights are downloaded.

* `build_tiny_pair`: a tiny Llama target and a tinier Llama draft with the same vocabulary,
  random weights from a normal init wide enough that greedy decoding is not a string of
  ties (transformers builds and saves them), for the exactness rows.
* `write_llama_8b_shape`: Llama-3.1-8B's config.json beside a tokenizer, for vLLM's
  `load_format="dummy"` (random weights of the real shape, nothing to load): the cost rows.

Both use a real tokenizer folder (SmolLM2-135M's: 49,152 tokens): prompts are token ids,
the tokenizer only has to exist and cover them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Wide enough that the target's logits spread (a 0.02 init gives near-uniform logits on a
# random tiny model, and greedy ties); the draft shares the tokenizer, not the weights.
TINY_INIT_STD = 0.15
# Attention's output projection scaled down. A random model's greedy token is a near-tie
# among 49K logits and its attention spreads over random positions, so a retrieval cache
# of a third of the context flips almost every token at full scale (on an H100 the first
# run accepted 2 drafts of 744: the exactness rows then test rejections only). Scaled to
# 0.001, each token still depends on its context, and drafts are accepted about two times
# in three: both paths of the verification are exercised.
ATTENTION_SCALE = 0.001
# Names the tiny models' recipe in results.json: a later run redoes the exactness rows of
# models built otherwise.
TINY_TAG = f"tiny-llama std {TINY_INIT_STD} attention x{ATTENTION_SCALE}"
# The sampled jobs' model (`build_sampling_model`): 512 tokens of vocabulary, so that 2,000
# samples of a position fill a chi-square table, and the tests' wide init (0.5; their
# tiny_llama's recipe), at which the next-token distribution has a few dozen likely tokens.
SAMPLING_VOCAB = 512
SAMPLING_INIT_STD = 0.5
SAMPLING_TAG = f"sampling-llama vocab {SAMPLING_VOCAB} std {SAMPLING_INIT_STD}"

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}


def copy_tokenizer(tokenizer_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, dest / name)


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + sum(
        1 for t in data.get("added_tokens", []) if t["id"] >= len(data["model"]["vocab"]))


def build_llama(dest: Path, tokenizer_dir: Path, *, layers: int, hidden: int, heads: int,
                kv_heads: int, head_dim: int, seed: int, max_positions: int = 32768,
                vocab: int | None = None, init_std: float = TINY_INIT_STD,
                attention_scale: float = ATTENTION_SCALE, tag: str = TINY_TAG,
                layer_types: list[str] | None = None, sliding_window: int | None = None
                ) -> Path:
    """A random Llama saved as float32 safetensors with the tokenizer; reused if built
    by the same recipe (`tag`, written beside it). `vocab`: the model's vocabulary, the
    tokenizer's by default (a smaller one samples only ids the tokenizer also has).
    `layer_types` and `sliding_window`: sliding-window layers beside full ones."""
    recipe = dest / "recipe.txt"
    if recipe.exists() and recipe.read_text() == tag:
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab or tokenizer_vocab_size(tokenizer_dir),
                         hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_theta=10000.0,
                         initializer_range=init_std, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, torch_dtype="float32",
                         **({} if layer_types is None else
                            {"layer_types": layer_types, "sliding_window": sliding_window}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # attention adds a little to the residual stream: see ATTENTION_SCALE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
    model.save_pretrained(dest, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, dest)
    recipe.write_text(tag)
    return dest


def build_tiny_pair(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """(target, draft): 4 x 256 (4 query / 2 KV heads of 64) and 2 x 128 (2 / 1 of 64).
    Head size 64: FlashAttention 3 and CPU_ATTN both take it."""
    target = build_llama(root / "tiny-llama", tokenizer_dir, layers=4, hidden=256, heads=4,
                         kv_heads=2, head_dim=64, seed=0)
    draft = build_llama(root / "tiny-llama-draft", tokenizer_dir, layers=2, hidden=128,
                        heads=2, kv_heads=1, head_dim=64, seed=1)
    return target, draft


# The windowed jobs' target (bench/gpu_plan.py, `exact-*-window-*`): the tiny pair's target
# with 128-token sliding windows in layers 0 and 2 (Gemma 2's and gpt-oss's alternation).
WINDOW = 128
WINDOW_TAG = f"{TINY_TAG} window {WINDOW} alternating"


def build_windowed_model(root: Path, tokenizer_dir: Path) -> Path:
    """The tiny pair's target with sliding-window layers 0 and 2, full layers 1 and 3."""
    return build_llama(root / "tiny-llama-window", tokenizer_dir, layers=4, hidden=256,
                       heads=4, kv_heads=2, head_dim=64, seed=0, tag=WINDOW_TAG,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       sliding_window=WINDOW)


def build_sampling_model(root: Path, tokenizer_dir: Path) -> Path:
    """The sampled jobs' target (bench/gpu_plan.py `_sample_jobs`): 2 x 128 (2 heads of 64,
    which every backend takes), SAMPLING_VOCAB tokens, attention at full scale."""
    return build_llama(root / "sampling-llama", tokenizer_dir, layers=2, hidden=128, heads=2,
                       kv_heads=2, head_dim=64, seed=2, vocab=SAMPLING_VOCAB,
                       init_std=SAMPLING_INIT_STD, attention_scale=1.0, tag=SAMPLING_TAG)


def write_llama_8b_shape(dest: Path, tokenizer_dir: Path, **over) -> Path:
    """Llama-3.1-8B's config (plus `over`, e.g. fewer layers for a dry run) and a tokenizer:
    enough for `LLM(dest, load_format="dummy")`."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({**LLAMA_31_8B, **over}, indent=1))
    copy_tokenizer(tokenizer_dir, dest)
    return dest
