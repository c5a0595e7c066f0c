"""Content keys of a request's committed blocks: whether block summaries set earlier still
hold for the tokens a request has now (engine/summary_keeper.py sets a block's summaries
once, lazily, and keeps them while its content key stays the same)."""

from __future__ import annotations


def block_contents(batch, row: int, state, full: int, block_size: int) -> list[int] | None:
    """Content keys of request `row`'s first `full` blocks: a hash chained over each
    block's token ids after the previous block's key, seeded by what else changes the KV
    of the same tokens (the LoRA adapter), like vLLM's prefix-cache hashes; kept in
    `state.block_contents` and extended as blocks fill. None where tokens do not decide
    the KV (multimodal inputs, prompt embeddings): such blocks are always set."""
    request = batch.requests[row]
    if getattr(request, "mm_features", None):
        return None
    contents = state.block_contents
    known = len(contents)
    if not contents:
        lora = getattr(request, "lora_request", None)
        previous = hash(("vllm-triforce", getattr(lora, "lora_int_id", 0)))
    else:
        previous = contents[-1]
    if full <= known:
        return contents
    tokens = batch.committed_block_tokens(row, known * block_size, full * block_size)
    if tokens is None:
        return None
    for start in range(0, len(tokens), block_size):  # one read, then a hash per block
        previous = hash((previous, tuple(tokens[start:start + block_size])))
        contents.append(previous)
    return contents


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two lists (the usual case, `a` a prefix of
    `b`, is one comparison in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
