"""What TriForce reads of each request, kept on the host for Model Runner V2.

The V1 runner keeps a `CachedRequestState` per request (vllm/v1/worker/gpu_input_batch.py,
0.32.0): prompt ids, sampling params, block ids, sampled tokens, all host lists, which the
engine reads (engine/batch.py `token_ids` / `committed_block_tokens`, lazy summaries'
block ids, engine/plain_steps.py, engine/depth.decodes_plainly). Model Runner V2
(vllm/v1/worker/gpu/, 0.32.0 and 0.33.0) keeps none of them on the host: token ids live
in `req_states.all_token_ids` (UVA or device memory), block ids in `BlockTables` on the
device, sampling params only as per-slot arrays. `RequestRecords` keeps what TriForce
reads, fed by what the runner itself is fed:

- `add`: the scheduler's `NewRequestData` (`GPUModelRunner.add_requests`); under MRV2 a
  resumed request comes as new too, with `prefill_token_ids` = prompt + its outputs so far
  (`Scheduler.schedule`, `use_v2_model_runner`);
- `append_blocks`: `CachedRequestData.new_block_ids` (`GPUModelRunner.update_requests`);
- `remove`: finished and preempted ids (`GPUModelRunner.finish_requests`);
- `commit`: each step's committed tokens, read from the step's `StepBatch`; a request's
  tokens from steps the speculator did no work in (engine/plain_steps.py: no batch, no
  device read) are taken up then from vLLM's own history of them (`TokenHistory`).

Terms. A request's *known tokens*: its prefill tokens (the prompt, and after a resumption
the outputs it had), then every token committed since.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestRecord:
    """One request, read like V1's `CachedRequestState` (the attributes the engine reads):
    its known tokens are `prompt_token_ids` then `output_token_ids`."""
    req_id: str
    prompt_token_ids: list[int] | None  # None: the prompt came as embeddings
    num_prompt_tokens: int
    sampling_params: object | None
    block_ids: tuple[list[int], ...]    # per KV-cache group, logical -> physical
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt and every committed output."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    def get_token_id(self, pos: int) -> int:
        """The token at `pos`, -1 past the known tokens (as `CachedRequestState`)."""
        if pos < self.num_prompt_tokens:
            if self.prompt_token_ids is None:
                raise ValueError(f"token {pos} of request {self.req_id} came as a prompt "
                                 "embedding; its id is unknown")
            return self.prompt_token_ids[pos]
        pos -= self.num_prompt_tokens
        return self.output_token_ids[pos] if pos < len(self.output_token_ids) else -1


class RequestRecords(dict):
    """req_id -> RequestRecord for every request the runner holds: a mapping, as the V1
    runner's `requests`, so the engine's lookups (`records[req_id]`, `req_id in records`)
    read either."""

    def add(self, new_req) -> None:
        """A scheduled new (or resumed) request, from its `NewRequestData`: its known
        tokens are `prefill_token_ids` (MRV2's scheduler sets them)."""
        num_prompt = new_req.prompt_len
        self[new_req.req_id] = RequestRecord(
            req_id=new_req.req_id, prompt_token_ids=new_req.prompt_token_ids,
            num_prompt_tokens=num_prompt, sampling_params=new_req.sampling_params,
            block_ids=tuple(list(ids) for ids in new_req.block_ids),
            # None: the V1 scheduler's form, the prompt alone
            output_token_ids=list((new_req.prefill_token_ids or [])[num_prompt:]))

    def append_blocks(self, cached_reqs) -> None:
        """New blocks of running requests, from `CachedRequestData` (None: none new)."""
        for req_id, new_block_ids in zip(cached_reqs.req_ids, cached_reqs.new_block_ids):
            if new_block_ids is None or req_id not in self:
                continue
            for group, ids in zip(self[req_id].block_ids, new_block_ids):
                group.extend(ids)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            self.pop(req_id, None)

    def apply(self, scheduler_output) -> None:
        """A `SchedulerOutput`, in the order MRV2's `execute_model` applies it: finished
        and preempted requests leave, new ones come, running ones get their new blocks."""
        self.remove(scheduler_output.finished_req_ids)
        self.remove(scheduler_output.preempted_req_ids or ())
        for new_req in scheduler_output.scheduled_new_reqs:
            self.add(new_req)
        self.append_blocks(scheduler_output.scheduled_cached_reqs)

    def commit(self, batch, slots=None, history: "TokenHistory | None" = None) -> None:
        """Append what step `batch` (a StepBatch) committed for each decoding row: the
        verified tokens it accepted and its next token, positions
        [known, committed + 1). Example: a request knowing 8 tokens whose pass verified
        [t, d1, d2, d3] at positions 7..10, d1 accepted, r sampled: committed 9, so
        positions 8 (d1) and 9 (r) are appended.

        Tokens before the pass that no commit brought (the request's plain steps) are read
        from `history` at the row's slot (`slots`: host [R], MRV2's idx_mapping), in one
        copy for the batch; without a history they are an error."""
        missing = []  # (row, first, end): positions [first, end) before the pass
        for row in batch.decoding_rows():
            known, start = batch.requests[row].num_tokens, batch.verify_start[row]
            if known < start:
                if history is None:
                    raise RuntimeError(
                        f"request {batch.requests[row].req_id}: {known} tokens known, but "
                        f"its pass starts at position {start}; a step's commit was missed")
                missing.append((row, known, start))
        if missing:
            spans = history.read([(int(slots[row]), first, end)
                                  for row, first, end in missing])
            for (row, _, _), ids in zip(missing, spans):
                batch.requests[row].output_token_ids.extend(ids)
        for row in batch.decoding_rows():
            record = batch.requests[row]
            end = batch.committed[row] + 1
            record.output_token_ids.extend(batch.token_ids(row, record.num_tokens, end))


class TokenHistory:
    """Model Runner V2's own record of each request's tokens, read on the host: the
    runner's `req_states.all_token_ids` [max_num_reqs, max_model_len] by slot
    (vllm/v1/worker/gpu/states.py, 0.32.0 and 0.33.0; UVA host memory, or device memory
    where UVA is unavailable). The prefill tokens are written at the request's arrival, and
    each step's sampled tokens by the runner's `post_update` before the speculator runs,
    so after the step's first sync every token up to the step's own is there."""

    def __init__(self, all_token_ids: torch.Tensor):
        self.all_token_ids = all_token_ids

    def read(self, spans: list[tuple[int, int, int]]) -> list[list[int]]:
        """Tokens [first, end) of each (slot, first, end), in one copy to the host."""
        flat = torch.cat([self.all_token_ids[slot, first:end]
                          for slot, first, end in spans]).tolist()
        out, at = [], 0
        for _, first, end in spans:
            out.append(flat[at:at + end - first])
            at += end - first
        return out
