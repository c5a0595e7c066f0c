"""StepBatch.committed_block_tokens (the lazy summaries' content keys read it): committed
token ids by list slices, equal to `token_ids`' token-by-token answer."""

import types

import torch

from vllm_triforce.engine.batch import StepBatch


def make_batch(prompt):
    output = [200, 201, 202]  # positions 10..12, sampled by earlier steps
    tokens = (prompt or []) + output
    request = types.SimpleNamespace(prompt_token_ids=prompt, num_prompt_tokens=10,
                                    output_token_ids=output, get_token_id=tokens.__getitem__)
    # row 1's pass verified positions 13..16 ([t, d1, d2, d3]), the last rejected:
    # verify_start 13, committed 16
    return StepBatch(
        req_ids=["a", "b"], seq_lens=[5, 17], query_start_loc=[0, 1, 5], num_rejected=[0, 1],
        decoding=[True, True], next_tokens=[9, 9], verify_ids=[50, 300, 301, 302, 303],
        greedy=[True, True], block_table=torch.zeros(2, 4, dtype=torch.int32),
        temperature=torch.zeros(2), top_k=None, top_p=None, requests=[None, request])


def test_committed_block_tokens_equal_token_by_token():
    batch = make_batch(list(range(100, 110)))
    assert batch.committed[1] == 16 and batch.verify_start[1] == 13
    for start, end in ((0, 16), (0, 8), (8, 12), (8, 16), (12, 16), (14, 16), (10, 13)):
        assert batch.committed_block_tokens(1, start, end) == batch.token_ids(1, start, end)
    assert batch.committed_block_tokens(1, 8, 16) == [108, 109, 200, 201, 202, 300, 301, 302]


def test_no_prompt_ids_no_tokens():
    """Prompt embeddings: vLLM holds no prompt ids, so no content key can be made."""
    assert make_batch(None).committed_block_tokens(1, 0, 8) is None
