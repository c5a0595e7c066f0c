"""The Model Runner V2 adapter's pieces on synthetic MRV2 inputs (vllm_triforce/engine/mrv2/,
StepBatch.from_mrv2): no engine is built, MRV2 cannot run on a CPU (its kernels are Triton).

The step every batch test works on, block size 4, K = 3 draft slots, vocabulary 32; rows in
MRV2's order (vLLM's `sort_batch_req_ids`: verifications first), slots deliberately not
the rows:

| row | req | slot | pass                                   | seq_len | outcome                        |
|-----|-----|------|----------------------------------------|---------|--------------------------------|
| 0   | a   | 2    | [21, 30, 31, 32] at 7..10 (t + 3 drafts)| 11      | d1=30 kept, 2 rejected, r = 40 |
| 1   | c   | 0    | [64, 65, 66] at 4..6, last prefill chunk| 7       | sampled 70                     |
| 2   | b   | 1    | [100..104] at 0..4, prompt of 10        | 5       | partial prefill, nothing       |

a: prompt 10..15, outputs [20, 21], greedy. c: prompt 60..66, temperature 0.8, top-k 5,
min_p 0.1 (vLLM's plain sampler only). b: prompt 100..109, temperature 1, seed 7.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.states import SamplingStates
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from vllm_triforce.core.verify import sample_tokens, sampling_probs
from vllm_triforce.engine.batch import StepBatch
from vllm_triforce.engine.mrv2.draft_logits import (DraftLogitsBuffer, keep_logits,
                                                   temperature_only)
from vllm_triforce.engine.mrv2.requests import RequestRecords

BLOCK, K, VOCAB, MAX_REQS = 4, 3, 32, 4
PROMPTS = {"a": list(range(10, 16)), "c": list(range(60, 67)), "b": list(range(100, 110))}
OUTPUTS = {"a": [20, 21], "c": [], "b": []}  # sampled before this step
PARAMS = {"a": SamplingParams(temperature=0.0),
          "c": SamplingParams(temperature=0.8, top_k=5, min_p=0.1),
          "b": SamplingParams(temperature=1.0, seed=7)}
SLOTS = {"a": 2, "c": 0, "b": 1}
BLOCKS = {"a": [5, 6, 7, 9], "c": [1, 2], "b": [3, 4, 8]}
COMPUTED = {"a": 7, "c": 4, "b": 0}     # tokens with KV before the step
SCHEDULED = {"a": [21, 30, 31, 32], "c": [64, 65, 66], "b": [100, 101, 102, 103, 104]}
DRAFTS = {"a": [30, 31, 32]}
SAMPLED = {"a": [30, 40], "c": [70], "b": []}  # what vLLM's verification sampled
ROWS = ["a", "c", "b"]


# ----------------------------------------------------------------- synthetic MRV2 state

def mrv2_input_batch(rows=ROWS) -> InputBatch:
    """The verification pass's InputBatch as MRV2's `prepare_inputs` fills it for the step
    (only the fields without a default; both releases have the same ones)."""
    slots = np.array([SLOTS[r] for r in rows], dtype=np.intp)
    num_scheduled = np.array([len(SCHEDULED[r]) for r in rows], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(num_scheduled)]).astype(np.int32)
    computed = np.array([COMPUTED[r] for r in rows], dtype=np.int32)
    prefill_len = np.array([len(PROMPTS[r]) + len(OUTPUTS[r]) for r in rows], dtype=np.int32)
    num_drafts = np.array([len(DRAFTS.get(r, [])) for r in rows], dtype=np.int32)
    cu_logits = np.concatenate([[0], np.cumsum(num_drafts + 1)]).astype(np.int32)
    ids = torch.tensor(sum((SCHEDULED[r] for r in rows), []), dtype=torch.int32)
    num_tokens = int(qsl[-1])
    return InputBatch(
        req_ids=list(rows), num_reqs=len(rows), num_reqs_after_padding=len(rows),
        idx_mapping=torch.from_numpy(slots.astype(np.int64)), idx_mapping_np=slots,
        expanded_idx_mapping=torch.from_numpy(np.repeat(slots, num_drafts + 1)),
        expanded_local_pos=torch.zeros(int(cu_logits[-1]), dtype=torch.int32),
        num_scheduled_tokens=num_scheduled, num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens, num_draft_tokens=int(num_drafts.sum()),
        num_draft_tokens_per_req=num_drafts, query_start_loc=torch.from_numpy(qsl),
        query_start_loc_np=qsl, seq_lens=torch.from_numpy(computed + num_scheduled),
        seq_lens_cpu_upper_bound=torch.from_numpy(computed + num_scheduled),
        dcp_local_seq_lens=None, num_computed_tokens_np=computed, prefill_len_np=prefill_len,
        num_computed_prefill_tokens_np=np.minimum(computed, prefill_len),
        is_prefilling_np=computed < prefill_len, has_prefill=True,
        decode_graph_eligible=False, input_ids=ids,
        positions=torch.cat([torch.arange(COMPUTED[r], COMPUTED[r] + len(SCHEDULED[r]))
                             for r in rows]),
        is_padding=torch.zeros(num_tokens, dtype=torch.bool),
        logits_indices=torch.from_numpy(qsl[1:] - 1), cu_num_logits=torch.from_numpy(cu_logits),
        cu_num_logits_np=cu_logits, has_structured_output_reqs=False, prompt_lens=None)


def slot_values(dtype, fill):
    """A per-slot parameter as MRV2's `UvaBackedTensor` holds it: `.np` on the host, `.gpu`
    its device copy (here the same memory: the CPU is the device)."""
    host = np.full(MAX_REQS, fill, dtype=dtype)
    return types.SimpleNamespace(np=host, gpu=torch.from_numpy(host))


def sampling_states():
    """MRV2's `SamplingStates` for the step's slots, filled by vLLM's own `add_request`
    (its real object pins host memory, which needs a GPU)."""
    states = types.SimpleNamespace(
        vocab_size=VOCAB, temperature=slot_values(np.float32, 0.0),
        top_k=slot_values(np.int32, VOCAB), top_p=slot_values(np.float32, 1.0),
        min_p=slot_values(np.float32, 0.0), seeds=slot_values(np.int64, 0),
        seeds_set=np.zeros(MAX_REQS, dtype=bool),
        num_logprobs=np.full(MAX_REQS, -1, dtype=np.int32))
    for r, slot in SLOTS.items():
        SamplingStates.add_request(states, slot, PARAMS[r])
    return states


def new_request(r: str) -> NewRequestData:
    """What MRV2's scheduler sent when `r` arrived: prefill_token_ids = prompt + outputs."""
    return NewRequestData(
        req_id=r, prompt_token_ids=PROMPTS[r], mm_features=[], sampling_params=PARAMS[r],
        pooling_params=None, block_ids=(list(BLOCKS[r]),), num_computed_tokens=0,
        lora_request=None, prefill_token_ids=PROMPTS[r] + OUTPUTS[r])


def mrv2_records() -> RequestRecords:
    records = RequestRecords()
    for r in ROWS:
        records.add(new_request(r))
    return records


def mrv2_sampled():
    """num_sampled, num_rejected [R] and last_sampled [max_num_reqs, 1] by slot, as
    `postprocess_sampled` leaves them (slot 1's entry is stale: b sampled nothing)."""
    num_logits = [len(DRAFTS.get(r, [])) + 1 for r in ROWS]
    num_sampled = torch.tensor([len(SAMPLED[r]) for r in ROWS], dtype=torch.int32)
    num_rejected = torch.tensor([n - s if s else 0 for n, s in zip(num_logits, num_sampled)],
                                dtype=torch.int32)
    last_sampled = torch.full((MAX_REQS, 1), 999, dtype=torch.int64)
    for r in ROWS:
        if SAMPLED[r]:
            last_sampled[SLOTS[r], 0] = SAMPLED[r][-1]
    return num_sampled, num_rejected, last_sampled


def mrv2_block_table() -> torch.Tensor:
    """`BlockTables.input_block_tables[0]`: [max_num_reqs, 6], gathered in batch rows;
    the row past the batch holds another request's blocks (never to be read)."""
    table = torch.full((MAX_REQS, 6), 77, dtype=torch.int32)
    for row, r in enumerate(ROWS):
        table[row] = torch.tensor(BLOCKS[r] + [0] * (6 - len(BLOCKS[r])))
    return table


def mrv2_batch(records=None, previous=None) -> StepBatch:
    num_sampled, num_rejected, last_sampled = mrv2_sampled()
    return StepBatch.from_mrv2(mrv2_input_batch(), num_sampled, num_rejected, last_sampled,
                               sampling_states(), mrv2_block_table(),
                               records if records is not None else mrv2_records(),
                               block_size=BLOCK, max_lookahead=K, previous=previous)


# ----------------------------------------------------------- the same step on V1

def v1_batch() -> StepBatch:
    """The batch V1's border (`from_runner`) builds for the same step, from what the V1
    runner would hold: CachedRequestStates, the discard mask, a generator for b,
    greedy temperatures 0, top-k by row, next_token_ids with b's backup token."""
    requests = {r: CachedRequestState(
        req_id=r, prompt_token_ids=PROMPTS[r], mm_features=[], sampling_params=PARAMS[r],
        generator=None, block_ids=(list(BLOCKS[r]),), num_computed_tokens=COMPUTED[r],
        output_token_ids=list(OUTPUTS[r])) for r in ROWS}
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=ROWS, generators={2: torch.Generator()}),
        discard_request_mask=types.SimpleNamespace(np=np.array([False, False, True])),
        requests=requests)
    batch = mrv2_input_batch()
    cad = types.SimpleNamespace(
        num_reqs=3, block_table_tensor=mrv2_block_table()[:3], max_seq_len=11,
        seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc)
    metadata = types.SimpleNamespace(temperature=torch.tensor([0.0, 0.8, 1.0]),
                                     top_k=torch.tensor([VOCAB, 5, VOCAB], dtype=torch.int32),
                                     top_p=None)
    return StepBatch.from_runner(runner, cad, batch.input_ids, torch.tensor([40, 70, 109]),
                                 torch.tensor([2, 0, 0]), metadata, BLOCK, K)


# ------------------------------------------------------------------------ 1. the batch

def test_from_mrv2_reads_the_hand_worked_step():
    batch = mrv2_batch()
    assert batch.req_ids == ROWS
    assert batch.seq_lens == [11, 7, 5] and batch.query_start_loc == [0, 4, 7, 12]
    assert batch.num_rejected == [2, 0, 0] and batch.committed == [9, 7, 5]
    assert batch.decoding == [True, True, False]  # b's chunk sampled nothing
    # a and c: what vLLM sampled, read at their slots 2 and 0; b: its last prompt token
    assert batch.next_tokens == [40, 70, 109]
    assert batch.verify_ids == [21, 30, 31, 32, 64, 65, 66, 100, 101, 102, 103, 104]
    assert batch.greedy == [True, False, False]
    assert batch.seeded == [False, False, True] and batch.plain == [False, True, False]
    # width: (longest seq_len 11 + K 3) // 4 + 1 = 4 columns of 6; row 3 (77s) not read
    assert batch.block_table.tolist() == [[5, 6, 7, 9], [1, 2, 0, 0], [3, 4, 8, 0]]
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert batch.top_k.tolist() == [VOCAB, 5, VOCAB] and batch.top_p is None
    assert batch.token_ids(0, 0, 10) == PROMPTS["a"] + [20, 21, 30, 40]
    assert batch.token_ids(1, 0, 8) == PROMPTS["c"] + [70]


def test_from_mrv2_equals_the_v1_batch_of_the_same_step():
    mrv2, v1 = mrv2_batch(), v1_batch()
    for name in ("req_ids", "seq_lens", "query_start_loc", "num_rejected", "decoding",
                 "next_tokens", "verify_ids", "greedy", "seeded", "plain", "q_lens",
                 "committed", "verify_start"):
        assert getattr(mrv2, name) == getattr(v1, name), name
    assert mrv2.last_committed_rows.tolist() == v1.last_committed_rows.tolist()
    for name in ("block_table", "temperature", "top_k"):
        assert torch.equal(getattr(mrv2, name), getattr(v1, name).to(getattr(mrv2, name).dtype))
    assert mrv2.top_p is None and v1.top_p is None
    for row in mrv2.decoding_rows():
        end = mrv2.committed[row] + 1
        assert mrv2.token_ids(row, 0, end) == v1.token_ids(row, 0, end)
        assert (mrv2.committed_block_tokens(row, 0, mrv2.committed[row])
                == v1.committed_block_tokens(row, 0, v1.committed[row]))
    rows = [0, 1, 2]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mrv2.probs(logits, rows), v1.probs(logits, rows))


def test_from_mrv2_takes_the_unchanging_facts_from_the_previous_step():
    records = mrv2_records()
    first = mrv2_batch(records)
    again = mrv2_batch(RequestRecords(), previous=first)  # no record needed: reused
    assert again.requests is first.requests and again.plain is first.plain


def test_an_all_default_batch_leaves_top_k_and_top_p_out():
    states = sampling_states()
    states.top_k.np[:] = VOCAB
    num_sampled, num_rejected, last_sampled = mrv2_sampled()
    batch = StepBatch.from_mrv2(mrv2_input_batch(), num_sampled, num_rejected, last_sampled,
                                states, mrv2_block_table(), mrv2_records(), BLOCK, K)
    assert batch.top_k is None and batch.top_p is None


# ------------------------------------------------------------------------ the records

def test_records_commit_what_the_step_committed():
    records = mrv2_records()
    records.commit(mrv2_batch(records))
    assert records["a"].output_token_ids == [20, 21, 30, 40]  # d1 kept, r sampled
    assert records["c"].output_token_ids == [70]
    assert records["b"].output_token_ids == []  # a partial prefill commits no output
    assert records["a"].get_token_id(9) == 40 and records["a"].get_token_id(10) == -1


def test_records_refuse_a_missed_step():
    records = mrv2_records()
    del records["a"].output_token_ids[-1]  # position 7 (the pass's t) lost
    records["a"].output_token_ids.pop()
    with pytest.raises(RuntimeError, match="commit was missed"):
        records.commit(mrv2_batch(records))


def test_a_prompt_given_as_embeddings_has_no_ids():
    record = mrv2_records()["a"]
    record.prompt_token_ids = None
    with pytest.raises(ValueError, match="prompt embedding"):
        record.get_token_id(0)
    assert record.get_token_id(6) == 20  # outputs are known
