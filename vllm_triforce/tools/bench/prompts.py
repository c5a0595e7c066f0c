"""Benchmark prompts as token ids: Moby-Dick slices and a SOTU needle-in-a-haystack task."""

from __future__ import annotations

import random

NEEDLE_DEPTH = 0.4
QUESTION = "\n\nQuestion: What is the secret passphrase mentioned in the speeches above? " \
           "Answer: The secret passphrase is"


def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def book_prompts(model_dir, num_tokens: int, batch: int) -> list[list[int]]:
    """`batch` different Moby-Dick passages of exactly `num_tokens` tokens."""
    from vllm_triforce.assets import moby_dick_text

    ids = tokenizer(model_dir)(moby_dick_text())["input_ids"]
    stride = max((len(ids) - num_tokens) // max(batch, 1), 1)
    return [ids[i * stride: i * stride + num_tokens] for i in range(batch)]


def needle_prompts(model_dir, num_tokens: int, batch: int, seed: int = 0) -> list[dict]:
    """SOTU speeches with "The secret passphrase is NNNNNN." at 40% depth, then a question.

    Returns [{"ids": [...], "passphrase": "NNNNNN"}]; each prompt is `num_tokens` long and
    starts at a different speech. Another `seed` draws other passphrases and starts past the
    speeches of seeds below it (a fresh sample of documents).
    """
    from vllm_triforce.assets import sotu_documents

    tok = tokenizer(model_dir)
    docs = sorted(sotu_documents(), key=lambda d: (d["year"], d["name"]))
    rng = random.Random(seed)
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    out = []
    for b in range(batch):
        passphrase = f"{rng.randrange(100000, 1000000)}"
        needle = tok(f" The secret passphrase is {passphrase}. Remember it: {passphrase}. ",
                     add_special_tokens=False)["input_ids"]
        hay_len = num_tokens - len(needle) - len(question)
        hay = _haystack(tok, docs[((b + seed * batch) * 37) % len(docs):], hay_len)
        depth = int(hay_len * NEEDLE_DEPTH)
        out.append({"ids": hay[:depth] + needle + hay[depth:] + question,
                    "passphrase": passphrase})
    return out


def _haystack(tok, docs: list[dict], num_tokens: int) -> list[int]:
    ids: list[int] = []
    for doc in docs:
        ids += tok(f"{doc['year']}, {doc['name']}:\n{doc['text']}\n\n",
                   add_special_tokens=False)["input_ids"]
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]
