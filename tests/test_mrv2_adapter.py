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

import dataclasses
import inspect
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
    again = mrv2_batch(records, previous=first)
    assert again.requests is first.requests and again.plain is first.plain
    # c preempted and resumed between the two (plain steps build no batch): a new record
    records.add(new_request("c"))
    resumed = mrv2_batch(records, previous=again)
    assert resumed.requests is not first.requests and resumed.requests[1] is records["c"]


def test_the_plain_step_facts_of_mrv2_equal_the_batchs():
    """`PlainSteps.read_mrv2` reads only the pass's host arrays, and finds the rows
    `from_mrv2` finds decoding after reading the device: a (11 of its 8 prefill tokens) and
    c (its last prefill chunk ends at 7) sample, b (5 of 10) does not."""
    from vllm_triforce.engine.plain_steps import PlainSteps

    facts, batch = PlainSteps.read_mrv2(mrv2_input_batch()), mrv2_batch()
    assert facts.req_ids == batch.req_ids
    assert facts.query_start_loc.tolist() == batch.query_start_loc
    assert facts.seq_lens.tolist() == batch.seq_lens
    assert facts.decoding.tolist() == batch.decoding == [True, True, False]


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
    records["a"].output_token_ids.clear()  # positions 6 and 7 lost; the pass starts at 7
    with pytest.raises(RuntimeError, match="commit was missed"):
        records.commit(mrv2_batch(records))


def token_history():
    """MRV2's `req_states.all_token_ids` by slot as the runner has it when the speculator
    runs: each request's prefill tokens, then every token sampled since, this step's too;
    the rest of each row is stale (-7)."""
    from vllm_triforce.engine.mrv2.requests import TokenHistory

    tokens = torch.full((MAX_REQS, 16), -7, dtype=torch.int32)
    for r in ROWS:
        known = PROMPTS[r] + OUTPUTS[r] + SAMPLED[r]
        tokens[SLOTS[r], :len(known)] = torch.tensor(known)
    return TokenHistory(tokens)


def test_records_take_the_tokens_of_plain_steps_from_vllms_history():
    """a's record missed its last two outputs (steps the speculator did no work in): the
    commit reads positions 6 and 7 at a's slot 2 from the history, then the step's own."""
    records = mrv2_records()
    records["a"].output_token_ids.clear()
    slots = np.array([SLOTS[r] for r in ROWS])
    records.commit(mrv2_batch(records), slots, token_history())
    assert records["a"].output_token_ids == [20, 21, 30, 40]
    assert records["c"].output_token_ids == [70] and records["b"].output_token_ids == []


def test_the_history_reads_every_span_in_one_copy():
    history = token_history()
    spans = [(SLOTS["a"], 6, 10), (SLOTS["b"], 0, 3), (SLOTS["c"], 7, 7), (SLOTS["c"], 5, 8)]
    assert history.read(spans) == [[20, 21, 30, 40], [100, 101, 102], [], [65, 66, 70]]


def test_a_prompt_given_as_embeddings_has_no_ids():
    record = mrv2_records()["a"]
    record.prompt_token_ids = None
    with pytest.raises(ValueError, match="prompt embedding"):
        record.get_token_id(0)
    assert record.get_token_id(6) == 20  # outputs are known


# ------------------------------------------------------ vLLM's real (pure-Python) scheduler

SCHED_BLOCK = 16


@pytest.fixture(scope="module")
def scheduler_config(tiny_llama):
    """A VllmConfig with K draft slots. "ngram" because it loads no draft model: the
    scheduler reads only num_speculative_tokens."""
    from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,
                             VllmConfig)

    cache = CacheConfig(block_size=SCHED_BLOCK, enable_prefix_caching=False)
    return VllmConfig(
        model_config=ModelConfig(model=str(tiny_llama), dtype="float32", max_model_len=256),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=256, is_encoder_decoder=False),
        cache_config=cache,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=K,
                                             prompt_lookup_max=2, prompt_lookup_min=1))


def real_scheduler(config, num_blocks: int = 64, scheduler_class=None, log_stats=False):
    """vLLM's Scheduler (or `scheduler_class`: its AsyncScheduler) as MRV2 is served
    (resumed requests come as new ones); `log_stats`: it keeps spec-decode metrics."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=SCHED_BLOCK, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    scheduler = (scheduler_class or Scheduler)(
        vllm_config=config, kv_cache_config=kv, block_size=SCHED_BLOCK,
        structured_output_manager=StructuredOutputManager(config), log_stats=log_stats)
    scheduler.use_v2_model_runner = True
    return scheduler


def add_requests(scheduler, prompt_lens: dict[str, int], max_tokens: int = 20) -> None:
    from vllm.v1.request import Request

    for i, (req_id, n) in enumerate(prompt_lens.items()):
        scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=[(7 * i + j) % 500 for j in range(n)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None))


def run_step(scheduler, scheduler_output, sampled: dict[str, list[int]] | None = None):
    """The worker's answer to one step: `sampled[r]` for r (default one token, 500 + the
    step's index), nothing for a partial prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    tokens = []
    for r in req_ids:
        request = scheduler.requests[r]
        partial = request.num_computed_tokens < request.num_tokens
        tokens.append([] if partial else (sampled or {}).get(r, [500 + len(tokens)]))
    output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens,
                               req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
    return scheduler.update_from_output(scheduler_output, output)


def stock_handler():
    """MRV2's own DraftTokensHandler, without the CUDA stream its __init__ makes (used only
    for structured outputs, which these tests do not have)."""
    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    handler = DraftTokensHandler.__new__(DraftTokensHandler)
    handler.device, handler.req_ids, handler.draft_tokens_np = None, [], None
    return handler


def test_draft_counts_reach_the_real_scheduler(scheduler_config):
    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    scheduler = real_scheduler(scheduler_config)
    add_requests(scheduler, {"r0": 10, "r1": 11, "r2": 12})
    run_step(scheduler, scheduler.schedule())  # the three prompts, one token each
    req_ids = ["r0", "r1", "r2"]
    counts = DraftCounts(stock_handler())
    counts.set_depths(req_ids, [3, 0, 1])
    batch = types.SimpleNamespace(req_ids=req_ids, has_structured_output_reqs=False)
    counts.set_draft_tokens(batch, torch.full((3, K), 5))  # the runner's [R, K] drafts
    assert counts.stock.get_draft_tokens().draft_token_ids == [[-1] * K] * 3  # stock: K each
    scheduler.update_draft_token_ids(counts.get_draft_tokens())

    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"r0": 4, "r1": 1, "r2": 2}
    assert second.scheduled_spec_decode_tokens == {"r0": [-1] * K, "r2": [-1]}
    # r0 keeps 1 of its 3 drafts (2 sampled), r2 its only one (2 sampled), r1 decodes
    run_step(scheduler, second, {"r0": [600, 601], "r1": [602], "r2": [603, 604]})
    computed = {r: scheduler.requests[r].num_computed_tokens for r in req_ids}
    assert computed == {"r0": 12, "r1": 12, "r2": 14}


@pytest.mark.parametrize("shared", [False, True])
def test_async_drafts_cut_on_a_copy_keep_the_real_async_schedulers_counts(scheduler_config,
                                                                         shared):
    """Async scheduling: vLLM's real AsyncScheduler schedules K = 3 placeholder drafts for
    every decoding request; the runner cuts them to TriForce's depths {r0: 3, r1: 0, r2: 1}
    (`DraftCounts.trimmed`) and the step verifies that many. Cut on a copy, the scheduler's
    accounting after the step leaves each request with the tokens it really has; cut in
    place (the in-process executor shares the object), r1 would keep 3 tokens it never
    computed."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    scheduler = real_scheduler(scheduler_config, scheduler_class=AsyncScheduler)
    add_requests(scheduler, {"r0": 10, "r1": 11, "r2": 12})
    run_step(scheduler, scheduler.schedule())  # the three prompts, one token each
    second = scheduler.schedule()
    assert second.scheduled_spec_decode_tokens == {r: [-1] * K for r in ("r0", "r1", "r2")}
    assert second.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}
    counts = DraftCounts(stock_handler())
    counts.set_depths(["r0", "r1", "r2"], [3, 0, 1])
    cut = counts.trimmed(second)
    assert cut.num_scheduled_tokens == {"r0": 4, "r1": 1, "r2": 2}
    assert cut.total_num_scheduled_tokens == 7
    assert cut.scheduled_spec_decode_tokens == {"r0": [-1] * K, "r2": [-1]}
    assert second.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}  # untouched
    assert second.scheduled_spec_decode_tokens["r1"] == [-1] * K
    if shared:  # what an in-place cut would leave the scheduler
        second.num_scheduled_tokens = cut.num_scheduled_tokens
        second.total_num_scheduled_tokens = cut.total_num_scheduled_tokens
        second.scheduled_spec_decode_tokens = cut.scheduled_spec_decode_tokens
    # r0 keeps 1 of its 3 drafts (2 sampled), r2 its only one (2 sampled), r1 decodes
    run_step(scheduler, second, {"r0": [600, 601], "r1": [602], "r2": [603, 604]})
    computed = {r: scheduler.requests[r].num_computed_tokens for r in ("r0", "r1", "r2")}
    right = {"r0": 12, "r1": 12, "r2": 14}
    assert (computed != right) if shared else (computed == right), computed
    outputs = {r: len(scheduler.requests[r].output_token_ids) for r in ("r0", "r1", "r2")}
    assert outputs == {"r0": 3, "r1": 2, "r2": 3}


@pytest.mark.parametrize("noted", [False, True])
def test_vllms_metrics_count_the_drafts_verified_once_the_cut_is_noted(scheduler_config,
                                                                      noted):
    """The same async step through vLLM's real AsyncScheduler, its stats on: with the cut
    slots noted on the scheduler's own output (`note_cut`: vLLM's num_invalid_spec_tokens),
    vLLM's spec-decode metrics count the 4 drafts verified (r0 3, r2 1) and 2 accepted;
    without, all 9 scheduled slots as drafted. The roll-back of computed tokens is the same
    either way."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts, note_cut

    scheduler = real_scheduler(scheduler_config, scheduler_class=AsyncScheduler,
                               log_stats=True)
    add_requests(scheduler, {"r0": 10, "r1": 11, "r2": 12})
    run_step(scheduler, scheduler.schedule())
    second = scheduler.schedule()
    counts = DraftCounts(stock_handler())
    counts.set_depths(["r0", "r1", "r2"], [3, 0, 1])
    cut = counts.trimmed(second)
    if noted:
        note_cut(second, cut)
        assert second.num_invalid_spec_tokens == {"r1": K, "r2": K - 1}
    assert second.scheduled_spec_decode_tokens == {r: [-1] * K for r in ("r0", "r1", "r2")}
    outputs = run_step(scheduler, second, {"r0": [600, 601], "r1": [602], "r2": [603, 604]})
    stats = next(o.scheduler_stats for o in outputs.values() if o.scheduler_stats)
    spec = stats.spec_decoding_stats
    assert spec.num_accepted_tokens == 2
    assert spec.num_draft_tokens == (4 if noted else 3 * K)
    assert spec.num_drafts == 3  # r1 cut to 0 still counts (module docstring)
    computed = {r: scheduler.requests[r].num_computed_tokens for r in ("r0", "r1", "r2")}
    assert computed == {"r0": 12, "r1": 12, "r2": 14}


def test_the_cut_leaves_what_it_cannot_or_need_not_cut():
    """Synchronous scheduling already scheduled k_r (the same object back); structured
    outputs keep their drafts (their grammar bitmask counts them); a request without a depth
    this step (vLLM's warm-up batches) keeps its drafts."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    def output(spec, structured=False):
        out = SchedulerOutput.make_empty()
        out.scheduled_spec_decode_tokens = spec
        out.num_scheduled_tokens = {r: 1 + len(ids) for r, ids in spec.items()}
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.has_structured_output_requests = structured
        return out

    counts = DraftCounts(stock_handler())
    counts.set_depths(["a", "b"], [2, 0])
    synced = output({"a": [-1, -1]})
    assert counts.trimmed(synced) is synced
    structured = output({"a": [-1] * 3, "b": [-1] * 3}, structured=True)
    assert counts.trimmed(structured) is structured
    cut = counts.trimmed(output({"a": [-1] * 3, "b": [-1] * 3, "w": [-1] * 3}))
    assert cut.scheduled_spec_decode_tokens == {"a": [-1, -1], "w": [-1] * 3}
    assert cut.num_scheduled_tokens == {"a": 3, "b": 1, "w": 4}


def test_draft_counts_trim_real_ids_for_structured_outputs():
    """With structured outputs the stock handler hands the K real ids (for the grammar)."""
    from vllm.v1.outputs import DraftTokenIds

    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    stock = types.SimpleNamespace(
        get_draft_tokens=lambda: DraftTokenIds(["x", "y", "z"], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    counts = DraftCounts(stock)
    counts.set_depths(["x", "y"], [2, 0])  # z: no depth set this step (a dummy run's)
    assert counts.get_draft_tokens().draft_token_ids == [[1, 2], [], []]


def test_records_follow_the_real_scheduler(scheduler_config):
    """Blocks as the scheduler hands them out, finished requests gone, and a preempted
    request resumed as new with the outputs it had (MRV2's form of a resumption)."""
    scheduler = real_scheduler(scheduler_config, num_blocks=7)  # 6 usable: 3 + 3
    add_requests(scheduler, {"r0": 40, "r1": 40}, max_tokens=12)
    records, preempted, resumed, steps = RequestRecords(), set(), {}, 0
    while scheduler.requests and steps < 40:
        output = scheduler.schedule()
        records.apply(output)
        preempted |= output.preempted_req_ids or set()
        for new in output.scheduled_new_reqs:
            if new.req_id in preempted:
                resumed[new.req_id] = list(records[new.req_id].output_token_ids)
        for r in output.num_scheduled_tokens:
            request = scheduler.requests[r]
            assert records[r].block_ids[0] == scheduler.kv_cache_manager.get_block_ids(r)[0]
            assert records[r].num_prompt_tokens == request.num_prompt_tokens
            assert records[r].output_token_ids == list(request.output_token_ids)
        run_step(scheduler, output)
        for r in output.num_scheduled_tokens:  # the worker's commit, without a StepBatch
            if r in scheduler.requests and scheduler.requests[r].output_token_ids:
                records[r].output_token_ids[:] = scheduler.requests[r].output_token_ids
        steps += 1
    assert preempted == {"r1"}  # r0's fourth block came from r1
    assert len(resumed["r1"]) > 0  # it came back knowing the outputs it had
    assert not scheduler.requests and set(records) <= {"r0", "r1"}
    final = scheduler.schedule()
    records.apply(final)
    assert not records  # both finished


# ------------------------------------------------------------------- 3. draft logits

def test_keep_logits_writes_each_middle_token_at_its_slot_and_step():
    """A round of two drafting requests (K 3, 4 slots): row 0 at slot 3 held no middle
    token and emitted 2 (steps 0, 1); row 1 at slot 1 held 2 and emitted 2 (step 2, then
    step 3, past K: the spare row). Rows past `emitted` are padding."""
    buffer = DraftLogitsBuffer(MAX_REQS, K, VOCAB, torch.float32)
    logits = torch.arange(2 * 3 * VOCAB, dtype=torch.float32).view(2, 3, VOCAB) + 1
    keep_logits(buffer, logits, emitted=torch.tensor([2, 2]), slots=torch.tensor([3, 1]),
                first_k=torch.tensor([0, 2]))
    expected = torch.zeros(MAX_REQS, K, VOCAB)
    expected[3, 0], expected[3, 1], expected[1, 2] = logits[0, 0], logits[0, 1], logits[1, 0]
    assert torch.equal(buffer.logits, expected)
    assert buffer.logits.shape == (MAX_REQS, K, VOCAB) and buffer.logits.is_contiguous()


def test_keep_logits_refuses_another_dtype_than_the_verifiers():
    buffer = DraftLogitsBuffer(MAX_REQS, K, VOCAB, torch.bfloat16)
    with pytest.raises(TypeError, match="another q"):
        keep_logits(buffer, torch.zeros(1, 1, VOCAB), torch.tensor([1]), torch.tensor([0]),
                    torch.tensor([0]))


def verifier_q(draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """MRV2's verifier's draft distribution: the stored logits upcast to float32, divided
    by T, log-softmaxed (rejection_sampler_utils.py `_compute_global_logprobs_and_logsumexp`)."""
    return torch.log_softmax(draft_logits.float() / temperature, -1).exp()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_logits_give_the_verifier_the_distribution_tokens_were_drawn_from(dtype):
    """c (row 1, slot 0, T 0.8, top-k 5) drafts 3 middle tokens in one round: they are
    drawn from the temperature-only batch's probs of the round's logits, and
    softmax(draft_logits[0, k] / 0.8) is that distribution, for each k. With top-k
    applied (the V1 hand-off's distribution) the verifier would assume another q."""
    batch = mrv2_batch()
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)).to(dtype)
    buffer = DraftLogitsBuffer(MAX_REQS, K, VOCAB, dtype)
    keep_logits(buffer, logits[None], emitted=torch.tensor([3]), slots=torch.tensor([0]),
                first_k=torch.tensor([0]))
    drawn_from = temperature_only(batch).probs(logits, [1, 1, 1])
    q = verifier_q(buffer.logits[0], 0.8)
    torch.testing.assert_close(drawn_from, q, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(batch.probs(logits, [1, 1, 1]), q, atol=1e-3)  # top-k 5 of 32
    assert torch.equal(drawn_from, sampling_probs(logits, torch.full((3,), 0.8)))


def test_middle_draws_follow_the_verifiers_q():
    """20,000 draws of c's first middle token with core/verify.sample_tokens from the
    temperature-only probs: their frequencies are softmax(draft_logits[0, 0] / T)."""
    batch = temperature_only(mrv2_batch())
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    buffer = DraftLogitsBuffer(MAX_REQS, K, VOCAB, torch.float32)
    keep_logits(buffer, logits[None], torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    n = 20_000
    probs = batch.probs(logits, [1]).expand(n, VOCAB)
    draws = sample_tokens(probs, torch.zeros(n, dtype=torch.bool), [None] * n,
                          torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=VOCAB).double() / n
    q = verifier_q(buffer.logits[0, 0], 0.8).double()
    assert (freq - q).abs().max() < 4 * (q * (1 - q) / n).sqrt().max() + 1e-3


def test_temperature_only_keeps_everything_else():
    batch = mrv2_batch()
    plain = temperature_only(batch)
    assert plain.top_k is None and plain.top_p is None
    assert plain.committed == batch.committed and plain.seeded == batch.seeded
    assert plain.temperature is batch.temperature and plain.requests is batch.requests
    assert temperature_only(plain) is plain  # nothing to drop


# ----------------------------------------------- 4. the speculator, runner and worker

@pytest.fixture(scope="module")
def binding():
    """engine/mrv2/speculator.py: importing it imports vLLM's MRV2 runner and GPU worker."""
    from vllm_triforce.engine.mrv2 import speculator
    return speculator


def test_the_binding_classes_take_vllms_places(binding):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator
    from vllm.v1.worker.gpu_worker import Worker

    assert issubclass(binding.TriForceSpeculator, DraftModelSpeculator)  # runner's isinstance
    assert issubclass(binding.TriForceRunnerV2, GPUModelRunner)
    assert issubclass(binding.TriForceWorker, Worker)
    ours = inspect.signature(binding.TriForceSpeculator.propose).parameters
    theirs = inspect.signature(BaseSpeculator.propose).parameters
    assert list(ours) == list(theirs)  # same names, same order (R2 passes both ways)
    for method in ("load_model", "set_attn", "propose"):
        assert method in vars(binding.TriForceSpeculator)
    assert "_make_model_runner" in vars(binding.TriForceWorker)


class PlainDepth:
    """The depth chooser as a plain step sees it (engine/depth.DepthChooser): adaptive,
    one TP rank, its clock read once per step. Asked ahead (`plan_ahead`), it plans to
    draft (`drafts`) for the decoding requests it is asked about, and keeps the plan."""
    fixed_depth = None
    share = None

    def __init__(self, drafts: bool = True):
        self.begun, self.asked, self.taken, self.forgot = [], [], [], 0
        self.drafts = drafts
        self.ahead = None

    @property
    def planned_ahead(self) -> bool:
        return self.ahead is not None

    def plan_ahead(self, req_ids, max_depth, num_committed, plain) -> bool:
        self.asked.append((req_ids, max_depth, num_committed, plain))
        self.ahead = req_ids
        return self.drafts

    def forget_plan_ahead(self) -> None:
        self.forgot += 1
        self.ahead = None

    def begin(self, start, req_ids, **facts):
        self.begun.append(req_ids)
        return types.SimpleNamespace(end=lambda drafting: None,
                                     take_plan_ahead=self.taken.append)


class PlainStats:
    def __init__(self):
        self.depths, self.counts = [], {}

    def record_depths(self, depths):
        self.depths += depths

    def record_plain(self, decoding):
        self.depths += [0] * decoding

    def add(self, **counts):
        for name, n in counts.items():
            self.counts[name] = self.counts.get(name, 0) + n


def speculator_stand_in(records, drafted=None, budget_blocks=2, depth=None):
    """What TriForceSpeculator.propose reads of itself, built without vLLM's __init__
    (which loads a config); its step (`Drafting._run_step`, the V1 proposer's own, tested
    through the V1 runner) hands `drafted` (req_id -> drafts, none by default) and keeps
    the batch it was given. Its plain steps are the engine's own (engine/plain_steps.py),
    over a retrieval budget of `budget_blocks` blocks of 4: at 2, a (11 tokens, 22 at
    most) may draft; at 8 nobody can (b and c fit, and c needs vLLM's sampler)."""
    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    from vllm_triforce.config import BlockCounts
    from vllm_triforce.engine.mrv2.speculator import TriForceSpeculator
    from vllm_triforce.engine.plain_steps import PlainSteps

    stock = stock_handler()
    blocks = BlockCounts(block_size=BLOCK, budget_blocks=budget_blocks,
                         retrieval_sink_blocks=0, retrieval_recent_blocks=0)
    this = types.SimpleNamespace(
        draft_tokens=torch.zeros(MAX_REQS, K, dtype=torch.int64), num_speculative_steps=K,
        records=records, sampling_states=sampling_states(), _last_batch=None,
        block_tables=types.SimpleNamespace(input_block_tables=[mrv2_block_table()]),
        shape=types.SimpleNamespace(block_size=BLOCK), draft_counts=DraftCounts(stock),
        logits_buffer=DraftLogitsBuffer(MAX_REQS, K, VOCAB, dtype=torch.float32), stepped=[],
        plain_steps=PlainSteps(blocks, types.SimpleNamespace(lazy=True), depth or PlainDepth(),
                               PlainStats()),
        _handed_last=False, token_history=token_history(), plain_done=[], _pass_plain=None,
        plan_ahead=True)
    this.depth = this.plain_steps.depth
    this._plain_step_done = this.plain_done.append
    for name in ("_is_plain", "_any_seeded"):  # the speculator's own, on this stand-in
        setattr(this, name, types.MethodType(getattr(TriForceSpeculator, name), this))

    def run_step(batch, start, max_depth):
        this._last_batch = batch
        this.stepped.append((batch, max_depth))
        this.plan_at_step = this.depth.ahead  # the plan made ahead, still there to take
        return [list((drafted or {}).get(r, [])) for r in batch.req_ids], None, None

    this._run_step = run_step
    return this


def test_propose_commits_runs_the_step_and_hands_its_drafts(binding):
    """a (greedy) drafts 2 tokens and b (temperature 1, seeded) 1: they reach rows 0 and 2
    of the [R, K] drafts and the scheduler hears 2, 0, 1. The step's batch is
    temperature-only (the q MRV2's verifier assumes): c stays plain for its min_p, and
    each row carries its slot, where its draft logits go."""
    records = mrv2_records()
    this = speculator_stand_in(records, drafted={"a": [7, 8], "b": [5]})
    num_sampled, num_rejected, last_sampled = mrv2_sampled()
    drafts = binding.TriForceSpeculator.propose(
        this, mrv2_input_batch(), {}, {}, None, None, num_sampled, num_rejected,
        last_sampled, None, None, None, num_speculative_tokens=K)
    assert drafts.tolist() == [[7, 8, -1], [-1] * K, [5, -1, -1]]
    (batch, max_depth), = this.stepped
    assert max_depth == K and batch.next_tokens == [40, 70, 109]
    assert batch.plain == [False, True, False]
    assert batch.top_k is None and batch.top_p is None
    assert batch.slots.tolist() == [SLOTS[r] for r in ROWS]
    assert records["a"].output_token_ids == [20, 21, 30, 40]  # committed
    assert this.draft_counts.depths == {"a": 2, "c": 0, "b": 1}


def test_a_step_nobody_can_draft_in_reads_no_device_value(binding):
    """Every request fits a budget of 8 blocks: `propose` builds no batch (which would read
    the device), commits nothing, hands every request depth 0, and counts a plain step;
    the next step that does work takes a's tokens of that step up from vLLM's history."""
    records = mrv2_records()
    this = speculator_stand_in(records, budget_blocks=8)
    untouchable = types.SimpleNamespace()  # any read of num_sampled & co. would fail
    drafts = binding.TriForceSpeculator.propose(
        this, mrv2_input_batch(), {}, {}, None, None, untouchable, untouchable, untouchable,
        None, None, None, num_speculative_tokens=K)
    assert drafts.tolist() == [[-1] * K] * 3 and not this.stepped and this.plain_done
    assert this.draft_counts.depths == {"a": 0, "c": 0, "b": 0}  # under async: cut to 0
    assert records["a"].output_token_ids == [20, 21]
    assert this.plain_steps.stats.counts == {"host_plain_steps": 1}
    assert this.plain_steps.stats.depths == [0, 0]  # a and c decoded; b is prefilling
    assert this.plain_steps.depth.begun == [ROWS]
    # that step's outputs never reached a's record; the next working step reads them
    records["a"].output_token_ids[:] = [20]
    this.plain_steps = speculator_stand_in(records, budget_blocks=2).plain_steps  # a may draft
    binding.TriForceSpeculator.propose(
        this, mrv2_input_batch(), {}, {}, None, None, *mrv2_sampled(), None, None, None,
        num_speculative_tokens=K)
    assert len(this.stepped) == 1 and records["a"].output_token_ids == [20, 21, 30, 40]


@pytest.fixture
def one_token_steps(monkeypatch):
    """The hand-worked step with nothing handed last step: a, one output longer, decodes 1
    token (9 in all: past a 2-block budget; no drafts verified, one sampled), c as before;
    b is left out by the tests that use it."""
    monkeypatch.setitem(OUTPUTS, "a", [20, 21, 22])
    monkeypatch.setitem(COMPUTED, "a", 8)
    monkeypatch.setitem(SCHEDULED, "a", [22])
    monkeypatch.setitem(SAMPLED, "a", [30])
    monkeypatch.delitem(DRAFTS, "a")


def test_a_step_the_controller_keeps_plain_reads_no_device_value(binding, one_token_steps):
    """a (9 tokens) outgrows a 2-block budget, so only the depth controller stands between
    the step of a and c and a plain one: asked before any batch is built (`plan_ahead`),
    with each decoding request's length and whether it must decode plainly (c, for its
    min_p), it gives depth 0, and the step is a plain one that takes that plan and reads
    nothing of the device."""
    records = mrv2_records()
    depth = PlainDepth(drafts=False)
    this = speculator_stand_in(records, budget_blocks=2, depth=depth)
    untouchable = types.SimpleNamespace()  # any read of num_sampled & co. would fail
    drafts = binding.TriForceSpeculator.propose(
        this, mrv2_input_batch(["a", "c"]), {}, {}, None, None, untouchable, untouchable,
        untouchable, None, None, None, num_speculative_tokens=K)
    assert drafts.tolist() == [[-1] * K] * 2 and not this.stepped and this.plain_done
    assert depth.asked == [(["a", "c"], K, [9, 7], [False, True])]
    assert depth.taken == [["a", "c"]]  # the plan is the step's: timed and held to it
    assert this.draft_counts.depths == {"a": 0, "c": 0}
    assert this.plain_steps.stats.counts == {"host_plain_steps": 1}


def test_a_step_the_controller_drafts_in_keeps_the_plan_for_the_step(binding,
                                                                     one_token_steps):
    """Asked ahead, the controller drafts for a: the step runs (its batch built) and finds
    the plan made ahead still there to take (`DepthChooser.plan`), not made twice."""
    depth = PlainDepth(drafts=True)
    this = speculator_stand_in(mrv2_records(), drafted={"a": [7]}, budget_blocks=2,
                               depth=depth)
    drafts = binding.TriForceSpeculator.propose(
        this, mrv2_input_batch(["a", "c"]), {}, {}, None, None, *mrv2_sampled(), None, None,
        None, num_speculative_tokens=K)
    assert drafts.tolist()[0] == [7, -1, -1] and len(this.stepped) == 1
    assert len(depth.asked) == 1 and this.plan_at_step == ["a", "c"]


def test_the_controller_is_not_asked_ahead_for_a_seeded_request_or_when_turned_off(
        binding, one_token_steps):
    """b samples from its own seed (its depth is read from its length, not a clock), so a
    batch with a seeded request is never planned ahead; nor is any with `plan_ahead` off."""
    depth = PlainDepth(drafts=False)
    this = speculator_stand_in(mrv2_records(), budget_blocks=2, depth=depth)
    slots = np.array([SLOTS[r] for r in ROWS])
    assert this._any_seeded(slots) and not this._any_seeded(slots[:2])
    facts = this.plain_steps.read_mrv2(mrv2_input_batch(["a", "c"]))
    this.plan_ahead = False
    assert this._is_plain(facts, slots[:2], K) is False and depth.asked == []
    this.plan_ahead = True
    assert this._is_plain(facts, slots[:2], K) is True and len(depth.asked) == 1
    # a seeded request in the batch (c given a seed: the seed test alone, no prefill)
    this.sampling_states.seeds_set[SLOTS["c"]] = True
    assert this._is_plain(facts, slots[:2], K) is False and len(depth.asked) == 1
    assert depth.forgot == 3  # each pass forgets the last pass's plan first


def test_the_runner_steps_on_the_cut_copy(binding, monkeypatch):
    """TriForceRunnerV2.execute_model hands vLLM's the output cut to the last step's
    depths; a dummy run's goes through as it came."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    seen = []
    monkeypatch.setattr(binding.GPUModelRunnerV2, "execute_model",
                        lambda self, out, *args, **kwargs: seen.append((out, kwargs)))
    runner = object.__new__(binding.TriForceRunnerV2)  # vLLM's __init__ needs a GPU
    runner.speculator = types.SimpleNamespace(draft_counts=DraftCounts(stock_handler()))
    runner.speculator.draft_counts.set_depths(["a"], [1])
    out = SchedulerOutput.make_empty()
    out.scheduled_spec_decode_tokens = {"a": [-1] * K}
    out.num_scheduled_tokens, out.total_num_scheduled_tokens = {"a": 1 + K}, 1 + K
    runner.execute_model(out)
    runner.execute_model(out, dummy_run=True)
    (cut, _), (dummy, kwargs) = seen
    assert cut is not out and cut.num_scheduled_tokens == {"a": 2}
    assert dummy is out and kwargs == {"dummy_run": True}


def test_put_drafts_fills_each_rows_first_columns(binding):
    drafts = torch.full((3, K), 5, dtype=torch.int64)
    drafts.fill_(-1)
    binding.put_drafts(drafts, [[], [1, 2, 3], [4]])
    assert drafts.tolist() == [[-1, -1, -1], [1, 2, 3], [4, -1, -1]]
    binding.put_drafts(drafts, [[], [], []])  # nobody drafts: no copy at all
    assert drafts.tolist() == [[-1, -1, -1], [1, 2, 3], [4, -1, -1]]


def test_the_speculator_builds_from_a_real_config_and_keeps_vllms_names(binding, tiny_llama):
    """TriForceSpeculator's own __init__ (vLLM's StandaloneARSpeculator's, then TriForce's
    Drafting) on a real TriForce config, on this CPU: vLLM's `capture` stays the method
    MRV2's runner calls (TriForce's query/key capture is `layer_capture`), the step's
    state starts empty, and a dummy propose hands nobody drafts."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    import vllm_triforce
    from vllm_triforce.config import TriForceConfigError
    from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts

    vllm_triforce.register()
    spec = {"method": "triforce", "num_speculative_tokens": K, "retrieval_budget": 512}
    config = EngineArgs(model=str(tiny_llama), speculative_config=spec, max_model_len=1024,
                        max_num_seqs=MAX_REQS, block_size=16).create_engine_config()
    with set_current_vllm_config(config), pytest.raises(TriForceConfigError,
                                                        match="draft_sample_method"):
        binding.TriForceSpeculator(config, torch.device("cpu"))  # vLLM's default "greedy"
    config.speculative_config.draft_sample_method = "probabilistic"  # what the switch sets
    with set_current_vllm_config(config):
        speculator = binding.TriForceSpeculator(config, torch.device("cpu"))
    assert speculator.capture.__func__ is binding.StandaloneARSpeculator.capture
    assert speculator.layer_capture is None and speculator.records == {}
    assert speculator.shape.gamma2 == K and not speculator.shape.has_draft
    assert not speculator.shape.hands_off_probs  # its verifier reads draft_logits instead
    assert speculator.draft_tokens.shape == (MAX_REQS, K)
    assert speculator.draft_logits.data_ptr() == speculator.logits_buffer.flat.data_ptr()
    speculator.draft_counts = DraftCounts(stock_handler())
    drafts = speculator.propose(mrv2_input_batch(), {}, {}, None, None, *mrv2_sampled(), None,
                                None, None, dummy_run=True)
    assert drafts.shape == (3, K) and bool((drafts == -1).all())


@pytest.mark.parametrize("has_draft", [False, True])
def test_a_dummy_propose_reads_no_request(binding, monkeypatch, has_draft):
    """vLLM's dummy and profile batches: no request of ours is read and nobody drafts; with
    three levels the small draft runs over the batch as vLLM's draft model would (its
    activations belong in the profile), and what it drafted is dropped."""
    ran = []

    def stock_propose(self, input_batch, *args, **kwargs):
        ran.append(kwargs)
        self.draft_tokens[:input_batch.num_reqs] = 5  # the small draft's dummy drafts

    monkeypatch.setattr(binding.StandaloneARSpeculator, "propose", stock_propose)
    this = object.__new__(binding.TriForceSpeculator)  # vLLM's __init__ loads a config
    vars(this).update(vars(speculator_stand_in(RequestRecords())))  # no record: a real
    this.shape = types.SimpleNamespace(block_size=BLOCK, has_draft=has_draft)  # batch fails
    drafts = this.propose(mrv2_input_batch(), {}, {}, None, None, *mrv2_sampled(), None,
                          None, None, dummy_run=True, is_profile=True)
    assert drafts.tolist() == [[-1] * K] * 3 and this._last_batch is None
    assert not this.stepped and this.draft_counts.depths == {}
    assert [(k["dummy_run"], k["is_profile"]) for k in ran] == ([(True, True)] if has_draft
                                                                 else [])


# ----------------------------------- 4b. the middle level's logits, on a real (V1) engine

@pytest.mark.engine
@pytest.mark.parametrize("levels,wrong", [(2, False), (3, False), (2, True)])
def test_the_middle_rounds_keep_the_logits_each_handed_draft_was_drawn_from(
        tiny_llama, tiny_draft, levels, wrong, monkeypatch):
    """The middle loop's MRV2 hand-off (`HandOffBuffer.logits`, engine/middle.py) run by a
    V1 engine on this CPU, each batch row standing for its slot: after every step, for
    every drafting request r and draft k, softmax(kept logits [r, k] / T_r) is the
    distribution V1 was handed for that draft (with no top-k or top-p, both are
    temperature-only), i.e. the q MRV2's verifier would compute is the one the tokens were
    drawn from. Drafting is proven (drafts verified, and checked rows counted).
    `wrong`: the GPU check's negative control for MRV2 (`forcing.keep_wrong_logits`, jobs
    `sample-*-mrv2-wrong`) makes that q the handed one sharpened to its temperature, as
    V1's negative control hands V1 (`forcing.hand_off_wrong`)."""
    from vllm import SamplingParams

    from vllm_triforce.engine import middle
    from vllm_triforce.tools.bench import forcing

    import tiny_models
    from engine_helpers import (assert_drafted, drafter_of, free_llm, in_process_llm,
                                make_engine_kwargs)
    from test_triforce_engine import three_level, two_level

    wrong_t = 0.5
    if wrong:
        monkeypatch.setattr(middle, "keep_logits",
                            forcing.keep_wrong_logits(middle.keep_logits, wrong_t))
    spec = two_level() if levels == 2 else three_level(tiny_draft)
    llm = in_process_llm(tiny_llama, spec, **make_engine_kwargs(max_num_seqs=4))
    checked = []
    try:
        drafter = drafter_of(llm)
        hand_off = drafter._probs_buffer
        hand_off.logits = DraftLogitsBuffer(4, drafter.shape.gamma2, drafter.shape.vocab_size,
                                            dtype=torch.float32)
        run_step, propose = drafter._run_step, drafter.propose

        def run_step_by_row(batch, start, max_depth):  # row r stands for slot r
            batch.slots = torch.arange(batch.num_reqs)
            return run_step(batch, start, max_depth)

        def checked_propose(*args, **kwargs):
            drafts = propose(*args, **kwargs)
            probs, req_ids = drafter.take_last_draft_probs(), drafter.last_draft_prob_req_ids()
            batch = drafter._last_batch
            for i, req_id in enumerate(req_ids or ()):
                r = batch.req_ids.index(req_id)
                k, t = len(drafts[r]), float(batch.temperature[r])
                q = torch.softmax(hand_off.logits.logits[r, :k] / t, dim=-1)
                if not wrong:
                    torch.testing.assert_close(q, probs[i, :k], rtol=1e-5, atol=1e-6)
                else:  # sharpened: proportional to handed ** (1 / wrong_t)
                    sharpened = torch.softmax(probs[i, :k].log() / wrong_t, dim=-1)
                    torch.testing.assert_close(q, sharpened, rtol=1e-4, atol=1e-6)
                    assert not torch.allclose(q, probs[i, :k], atol=1e-3)
                checked.append(k)
            return drafts

        drafter._run_step, drafter.propose = run_step_by_row, checked_propose
        prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate((230, 260, 300))]
        params = [SamplingParams(temperature=t, max_tokens=16, ignore_eos=True, seed=i)
                  for i, t in enumerate((0.7, 1.0, 1.3))]
        llm.generate(prompts, params, use_tqdm=False)
        assert_drafted(drafter.stats.snapshot(), levels=levels)
    finally:
        free_llm(llm)
    assert len(checked) > 3 and sum(checked) > 10, checked


# ---------------------------------------------------------------------- 5. the contract

def test_the_contract_reads_mrv2s_instance_attributes_and_its_propose_calls(tmp_path):
    from vllm_triforce.tools import contract

    source = contract.Sources(contract.installed_root())
    assert source.defines("vllm.v1.worker.gpu.sample.states", "SamplingStates.top_k") == []
    assert source.defines("vllm.v1.worker.gpu.sample.states", "SamplingStates.top_m") != []
    assert contract.speculator_call_problems(source) == []
    runner = tmp_path / "vllm" / "v1" / "worker" / "gpu" / "model_runner.py"
    runner.parent.mkdir(parents=True)
    runner.write_text("class GPUModelRunner:\n    def step(self):\n"
                      "        self.speculator.propose(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"
                      " hidden_mask=None)\n")
    problems = contract.speculator_call_problems(contract.Sources(tmp_path))
    assert any("propose(hidden_mask=...)" in p for p in problems), problems
