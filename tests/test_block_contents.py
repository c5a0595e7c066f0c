"""engine/block_contents.py: a request's content keys are a hash chained over its full
blocks' token ids, seeded by its LoRA adapter, extended as blocks fill; None where
tokens do not decide the KV."""

from types import SimpleNamespace

from vllm_triforce.engine.block_contents import block_contents, common_prefix
from vllm_triforce.engine.state import RequestState

BS = 4
TOKENS = list(range(100, 123))  # 5 full blocks of 4, and 3 tokens


def batch_of(tokens, request=None, reads=None):
    """A StepBatch stand-in: one request whose committed tokens are `tokens`; `reads`
    collects each (start, end) read."""
    def committed_block_tokens(row, start, end):
        if reads is not None:
            reads.append((start, end))
        return None if tokens is None else tokens[start:end]

    return SimpleNamespace(requests=[request or SimpleNamespace()],
                           committed_block_tokens=committed_block_tokens)


def chained(tokens, full, lora_id=0):
    previous, out = hash(("vllm-triforce", lora_id)), []
    for i in range(full):
        previous = hash((previous, tuple(tokens[i * BS:(i + 1) * BS])))
        out.append(previous)
    return out


def test_keys_chain_over_blocks_and_extend_with_one_read():
    reads = []
    state = RequestState()
    assert block_contents(batch_of(TOKENS, reads=reads), 0, state, 3, BS) == chained(TOKENS, 3)
    assert block_contents(batch_of(TOKENS, reads=reads), 0, state, 5, BS) == chained(TOKENS, 5)
    assert block_contents(batch_of(TOKENS, reads=reads), 0, state, 5, BS) == chained(TOKENS, 5)
    assert reads == [(0, 12), (12, 20)]  # one read per call that adds blocks, none after
    # the same tokens after another prefix, or under another adapter, key differently
    other = TOKENS[:4][::-1] + TOKENS[4:]
    assert block_contents(batch_of(other), 0, RequestState(), 5, BS)[1:] != chained(TOKENS, 5)[1:]
    lora = SimpleNamespace(lora_request=SimpleNamespace(lora_int_id=7))
    assert (block_contents(batch_of(TOKENS, lora), 0, RequestState(), 2, BS)
            == chained(TOKENS, 2, lora_id=7) != chained(TOKENS, 2))


def test_no_keys_where_tokens_do_not_decide_the_kv():
    assert block_contents(batch_of(None), 0, RequestState(), 2, BS) is None  # embeddings
    multimodal = SimpleNamespace(mm_features=[object()])
    assert block_contents(batch_of(TOKENS, multimodal), 0, RequestState(), 2, BS) is None


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 5, 3], [1, 2, 3]) == 1
    assert common_prefix([], [1]) == 0
