"""What one vLLM step tells the proposer: host values as Python lists, device values as tensors.

Read from vLLM 0.32.0's V1 runner (`GPUModelRunner.propose_draft_token_ids`, padded-batch
path): the verification pass's `CommonAttentionMetadata` (after `prepare_inputs_padded`),
`num_rejected_tokens_gpu`, the sampled `next_token_ids` and `discard_request_mask`.

Worked example, one request, gamma2 = 3: the verification pass ran tokens
[t, d1, d2, d3] at positions 100..103 (q_len 4, seq_len 104); d1 was accepted, d2
rejected, so num_rejected = 2 and vLLM sampled a recovered token r at position 102.
committed = seq_len - num_rejected = 102: positions < 102 now hold exact KV (t, d1),
r is `next_token` at position `committed` and has no KV yet.

Model Runner V2 (vllm/v1/worker/gpu/, 0.32.0 and 0.33.0) tells the same step otherwise
(`from_mrv2`): its `InputBatch` in batch rows, and per request-state *slot* (a request's
row in the runner's persistent state, `input_batch.idx_mapping[row]`, which is not its
batch row) the last sampled tokens and the sampler's parameters. Both build the same batch.
"""

from __future__ import annotations

import operator

from dataclasses import dataclass

import numpy as np
import torch

from vllm_triforce.core.verify import GREEDY_TEMPERATURE, sampling_probs
from vllm_triforce.engine.depth import decodes_plainly
from vllm_triforce.engine.device.transfer import to_device, to_host


@dataclass
class StepBatch:
    """Host values as Python lists (one device-to-host copy per step made them), device
    values as tensors: on a GPU reading a host list never waits for the device."""
    req_ids: list[str]
    seq_lens: list[int]          # [R] tokens seen by the verification pass
    query_start_loc: list[int]   # [R + 1] rows of the verification pass
    num_rejected: list[int]      # [R]
    decoding: list[bool]         # [R] sampled a real token (not a partial prefill)
    next_tokens: list[int]       # [R]
    verify_ids: list[int]        # [num_tokens] input ids of the verification pass
    greedy: list[bool]           # [R] temperature below GREEDY_TEMPERATURE
    block_table: torch.Tensor    # device [R, width] int32 physical block ids
    temperature: torch.Tensor    # device [R] float32 (0 for greedy rows)
    top_k: torch.Tensor | None   # device [R] int64
    top_p: torch.Tensor | None   # device [R] float32
    requests: list               # [R] vLLM CachedRequestState, for older token ids
    # [R] samples from a generator of its own (a seed, temperature > 0): vLLM's
    # `input_batch.generators`; None: no request does
    seeded: list[bool] | None = None
    # [R] needs vLLM's plain sampler for every token (engine/depth.decodes_plainly: min_p,
    # logit_bias); None: no request does
    plain: list[bool] | None = None
    # [R] never drafts (engine/plain_steps.never_drafts): the proposer sets it after
    # building the batch; None: every request may
    never_drafts: np.ndarray | None = None
    # [R] int64: where the target rotates with M-RoPE (Qwen2-VL and its kind), each
    # request's `mrope_position_delta`: a generated token at position p rotates at p + delta
    # in all three sections, as vLLM's runner places it; None: 1-D RoPE, or every delta 0
    rope_shift: np.ndarray | None = None
    # device [R] int64: each row's request-state slot in Model Runner V2 (where its draft
    # logits go, engine/mrv2/draft_logits.py); None on the V1 runner
    slots: torch.Tensor | None = None
    # KV-cache group id -> device [R, width] int32: the block tables of the groups the
    # target's local layers sit in (engine/device/forward.py `WindowLayers`),
    # other than `block_table`'s; None: no such group
    window_tables: dict[int, torch.Tensor] | None = None

    def __post_init__(self):
        if self.seeded is None:
            self.seeded = [False] * len(self.req_ids)
        if self.plain is None:
            self.plain = [False] * len(self.req_ids)
        seq_lens = np.asarray(self.seq_lens, dtype=np.int64)
        q_lens = np.diff(np.asarray(self.query_start_loc, dtype=np.int64))
        self.q_lens = q_lens.tolist()  # [R]
        # [R] tokens with exact KV (also as an array, to index by many rows at once), and
        # the first position of the verification pass
        self.committed_array = seq_lens - np.asarray(self.num_rejected, dtype=np.int64)
        self.committed = self.committed_array.tolist()
        # [R] row, in the verification pass, of each request's last committed token
        self.last_committed_rows = (np.asarray(self.query_start_loc[1:], dtype=np.int64)
                                    - np.asarray(self.num_rejected, dtype=np.int64) - 1)
        self.verify_start = (seq_lens - q_lens).tolist()
        self.greedy_array = np.asarray(self.greedy, dtype=bool)  # [R]
        self._decoding_rows = (list(range(len(self.req_ids))) if all(self.decoding)
                               else np.flatnonzero(self.decoding).tolist())

    def decoding_rows(self) -> list[int]:
        """The rows that sampled a real token (not a partial prefill), in order."""
        return self._decoding_rows

    def all_greedy(self, rows) -> bool:
        """Every one of requests `rows` (a list or array of rows) is greedy."""
        return bool(self.greedy_array[rows].all())

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    def rows_on_device(self, rows: list[int]) -> torch.Tensor:
        """[n] int64 row indices on the device (a non-blocking copy)."""
        return to_device(self.device, rows)[0]

    def probs(self, logits: torch.Tensor, rows: list[int],
              rows_dev: torch.Tensor | None = None) -> torch.Tensor:
        """[n, V] logits -> the [n, V] distributions their requests' sampling params give:
        the same transform at every level (temperature, top-k, top-p; one-hot when greedy).
        `rows` [n]: the request row of each logits row; or, with `rows_dev` (the request
        row of each logits row, on the device), the requests they belong to, each listed
        once (the host reads only their greedy flags). One call per pass or chunk of one,
        not per request: the vocabulary-wide work is batched."""
        if rows_dev is None:
            rows_dev = self.rows_on_device(rows)

        def per_token(values):
            return None if values is None else values[rows_dev]

        return sampling_probs(logits, per_token(self.temperature), per_token(self.top_k),
                              per_token(self.top_p),
                              all_greedy=self.all_greedy(rows))

    def token_ids(self, row: int, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of request `row` (end <= committed + 1)."""
        verify_start, committed = self.verify_start[row], self.committed[row]
        first_row = self.query_start_loc[row]
        request = self.requests[row]
        out = []
        for pos in range(start, end):
            if pos == committed:
                out.append(self.next_tokens[row])
            elif pos >= verify_start:
                out.append(self.verify_ids[first_row + pos - verify_start])
            else:
                out.append(int(request.get_token_id(pos)))
        return out

    def committed_block_tokens(self, row: int, start: int, end: int) -> list[int] | None:
        """Token ids at committed positions [start, end) of request `row` (end <= committed),
        by list slices (`token_ids` goes token by token); None when vLLM holds no prompt ids
        (prompt embeddings). Positions before the verification pass are in vLLM's
        `CachedRequestState` lists, the pass's own in `verify_ids`."""
        request, verify_start = self.requests[row], self.verify_start[row]
        prompt, num_prompt = request.prompt_token_ids, request.num_prompt_tokens
        if prompt is None:
            return None
        stop = min(end, verify_start)
        out = list(prompt[start:min(stop, num_prompt)])
        if stop > num_prompt:
            out += request.output_token_ids[max(start, num_prompt) - num_prompt:stop - num_prompt]
        if end > verify_start:
            first = self.query_start_loc[row] - verify_start
            out += self.verify_ids[first + max(start, verify_start):first + end]
        return out if len(out) == end - start else None

    @classmethod
    def from_runner(cls, runner, cad, target_token_ids, next_token_ids, num_rejected_tokens_gpu,
                    sampling_metadata, block_size: int, max_lookahead: int,
                    previous: "StepBatch | None" = None, table_group: int = 0,
                    window_groups: dict[int, int] | None = None) -> "StepBatch":
        """`max_lookahead`: positions past seq_len this step may touch (gamma2); the block
        table is kept (on the device) only as wide as that needs, not max_model_len /
        block_size. What the host needs comes in ONE copy (`to_host`): on a GPU each separate
        `.tolist()` would be a sync. `previous`: the last step's batch; where its requests
        are this one's, in the same rows, what never changes during a request (its
        `CachedRequestState`, whether it is seeded, whether it decodes plainly) is taken
        from it instead of read per request. `table_group`: the KV-cache group of the
        target's full-attention layers (`cad` holds group 0's table: vLLM hands a draft
        model's proposer the first group's metadata); `window_groups`: KV-cache group id ->
        block size of the groups of its local layers, whose tables the batch
        keeps too (`window_tables`)."""
        num_reqs = cad.num_reqs
        device = next_token_ids.device
        table = _group_table(runner, cad, table_group)
        width = _table_width(table, cad.max_seq_len, max_lookahead, block_size)
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        rejected = (torch.zeros(num_reqs, dtype=torch.long, device=device)
                    if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:num_reqs])
        temperature = sampling_metadata.temperature
        if temperature is None:  # vLLM leaves it out of an all-greedy batch
            temperature = torch.zeros(num_reqs, device=device)
        temperature = temperature[:num_reqs].float()
        seq_lens, qsl, rejected, next_tokens, verify_ids, greedy = to_host(
            cad.seq_lens[:num_reqs], cad.query_start_loc[:num_reqs + 1], rejected,
            next_token_ids[:num_reqs], target_token_ids, temperature < GREEDY_TEMPERATURE)
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        discard = runner.discard_request_mask.np[:num_reqs]  # numpy: a host array
        if previous is not None and previous.req_ids == req_ids:
            requests, seeded, plain = previous.requests, previous.seeded, previous.plain
        else:
            requests = [runner.requests[r] for r in req_ids]
            generators = runner.input_batch.generators
            seeded = [i in generators for i in range(num_reqs)] if generators else None
            plain = [decodes_plainly(r.sampling_params) for r in requests]
        return cls(
            req_ids=req_ids, seq_lens=seq_lens, query_start_loc=qsl, num_rejected=rejected,
            decoding=(~discard).tolist(), next_tokens=next_tokens, verify_ids=verify_ids,
            greedy=(np.asarray(greedy) == 1).tolist(),
            block_table=table[:num_reqs, :width].to(torch.int32).clone(),
            window_tables=_window_tables(runner, cad, window_groups, max_lookahead),
            temperature=temperature,
            top_k=None if top_k is None else top_k[:num_reqs],
            top_p=None if top_p is None else top_p[:num_reqs],
            requests=requests, seeded=seeded, plain=plain,
            rope_shift=_rope_shift(requests) if getattr(runner, "uses_mrope", False) else None,
        )

    @classmethod
    def from_mrv2(cls, input_batch, num_sampled, num_rejected, last_sampled, sampling,
                  block_table, requests, block_size: int, max_lookahead: int,
                  previous: "StepBatch | None" = None) -> "StepBatch":
        """The batch `from_runner` builds, from what Model Runner V2 hands its speculator
        (`GPUModelRunner.sample_tokens` -> `speculator.propose`, vllm/v1/worker/gpu/
        model_runner.py, 0.32.0 and 0.33.0), after `postprocess_sampled`:

        - `input_batch`: the verification pass's `InputBatch` (batch rows: req_ids,
          idx_mapping, query_start_loc, seq_lens, input_ids, num_tokens);
        - `num_sampled`, `num_rejected`: device [num_reqs] (0 sampled: a partial prefill,
          vLLM's `get_num_sampled_and_rejected`);
        - `last_sampled`: device [max_num_reqs, 1] by slot (`req_states.last_sampled_tokens`,
          already holding this step's token);
        - `sampling`: the sampler's `SamplingStates` (`runner.sampler.sampling_states`):
          temperature / top_k / top_p by slot, each a host array `.np` (the source of truth)
          and its device copy `.gpu`; top-k = vocab_size and top-p = 1 mean off; and
          `seeds_set` [max_num_reqs], a seed given by the user;
        - `block_table`: device [>= num_reqs, max_blocks], the pass's table in batch rows
          (`BlockTables.input_block_tables[0]`; the per-layer `attn_metadata` MRV2 passes
          is each backend's own type, its common fields are these);
        - `requests`: req_id -> a record that reads like V1's `CachedRequestState`
          (engine/mrv2/requests.py: MRV2 keeps no such object on the host).

        One device-to-host copy, as `from_runner`. A partial prefill's `next_token` is its
        last known token (V1's backup token: no token was sampled for it).

        Example, slots are not rows: rows [a, c] at slots idx_mapping [2, 0] read
        last_sampled[2] and last_sampled[0], temperature.np[2] and temperature.np[0]."""
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        slots = input_batch.idx_mapping[:num_reqs]  # device [R]
        slots_np = np.asarray(input_batch.idx_mapping_np[:num_reqs])  # host [R]
        sampled_tokens = last_sampled.reshape(last_sampled.shape[0], -1)[slots, -1]  # [R]
        seq_lens, qsl, rejected, sampled, sampled_tokens, verify_ids = to_host(
            input_batch.seq_lens[:num_reqs], input_batch.query_start_loc[:num_reqs + 1],
            num_rejected[:num_reqs], num_sampled[:num_reqs], sampled_tokens,
            input_batch.input_ids[:input_batch.num_tokens])
        # the same records, not only the same ids: a request preempted and resumed since
        # (between plain steps, which build no batch) comes back as a new record
        if (previous is not None and previous.req_ids == req_ids
                and all(map(operator.is_, previous.requests, map(requests.get, req_ids)))):
            records, plain = previous.requests, previous.plain
        else:
            records = [requests[r] for r in req_ids]
            plain = [decodes_plainly(r.sampling_params) for r in records]
        decoding = [n > 0 for n in sampled]
        next_tokens = [token if d else _last_known_token(record)
                       for token, d, record in zip(sampled_tokens, decoding, records)]
        greedy = sampling.temperature.np[slots_np] < GREEDY_TEMPERATURE  # host [R]
        temperature = sampling.temperature.gpu[slots].float()
        temperature = torch.where(temperature < GREEDY_TEMPERATURE, 0.0, temperature)
        seeded = sampling.seeds_set[slots_np] & ~greedy  # vLLM's RANDOM_SEED requests
        width = _table_width(block_table, max(seq_lens, default=0), max_lookahead, block_size)
        return cls(
            req_ids=req_ids, seq_lens=seq_lens, query_start_loc=qsl, num_rejected=rejected,
            decoding=decoding, next_tokens=next_tokens, verify_ids=verify_ids,
            greedy=greedy.tolist(),
            block_table=block_table[:num_reqs, :width].to(torch.int32).clone(),
            temperature=temperature,
            top_k=_used_by_slot(sampling.top_k, slots, slots_np, off=sampling.vocab_size),
            top_p=_used_by_slot(sampling.top_p, slots, slots_np, off=1.0),
            requests=records,
            seeded=seeded.tolist() if seeded.any() else None, plain=plain,
            slots=slots.long(),
        )


def _rope_shift(requests: list) -> np.ndarray | None:
    """[R] each request's M-RoPE position delta (vLLM's `CachedRequestState.
    mrope_position_delta`, set at its prefill: the positions its images or videos took
    beyond their token count, negative where they took fewer); None where every one is 0
    (text only), where M-RoPE rotates a generated token as 1-D RoPE does."""
    shift = np.fromiter((r.mrope_position_delta or 0 for r in requests), dtype=np.int64,
                        count=len(requests))
    return shift if shift.any() else None


def _group_table(runner, cad, gid: int) -> torch.Tensor:
    """KV-cache group `gid`'s block table of the step's batch (device, batch rows): the
    one `cad` holds for group 0, else the runner's (`input_batch.block_table[gid]`, where
    vLLM's pass read it, vllm/v1/worker/gpu_model_runner.py `_get_block_table`)."""
    if gid == 0:
        return cad.block_table_tensor
    return runner.input_batch.block_table[gid].get_device_tensor(cad.num_reqs)


def _window_tables(runner, cad, groups: dict[int, int] | None,
                   max_lookahead: int) -> dict[int, torch.Tensor] | None:
    """`StepBatch.window_tables`: each of `groups`' (gid -> block size) tables, as wide
    as the step's positions need."""
    if not groups:
        return None
    tables = {}
    for gid, block_size in groups.items():
        table = _group_table(runner, cad, gid)
        width = _table_width(table, cad.max_seq_len, max_lookahead, block_size)
        tables[gid] = table[:cad.num_reqs, :width].to(torch.int32).clone()
    return tables


def of_rows(values: list, rows) -> list:
    """values[r] for each of `rows` (sorted and distinct: a list or an int array), as a
    list, looked up by `map`; `values` itself when the rows are all of them (every request
    decodes, mostly). Example: of_rows(["a", "b", "c"], np.array([0, 2])) -> ["a", "c"]."""
    if len(rows) == len(values):
        return values
    return list(map(values.__getitem__, rows.tolist() if isinstance(rows, np.ndarray) else rows))


def _table_width(block_table: torch.Tensor, max_seq_len: int, max_lookahead: int,
                 block_size: int) -> int:
    """Columns of the block table a step can reach: its longest sequence plus the
    lookahead, never more than the table has."""
    return min(block_table.shape[1], (max_seq_len + max_lookahead) // block_size + 1)


def _used_by_slot(values, slots: torch.Tensor, slots_np: np.ndarray, off):
    """MRV2's per-slot sampling parameter (`.np` host, `.gpu` device) for the batch's rows,
    device [R]; None when no row uses it (every value is `off`), as V1's sampling
    metadata leaves it out (vLLM's `SamplingStates.get_top_k_top_p` decides alike)."""
    if np.all(values.np[slots_np] == off):
        return None
    return values.gpu[slots]


def _last_known_token(request) -> int:
    """The newest token vLLM holds for `request` (V1's `backup_next_token_ids`)."""
    return int(request.get_token_id(request.num_prompt_tokens
                                     + len(request.output_token_ids) - 1))
