"""What one vLLM step tells the proposer, as small host tensors.

Read from vLLM 0.32.0's V1 runner (`GPUModelRunner.propose_draft_token_ids`, padded-batch
path): the verification pass's `CommonAttentionMetadata` (after `prepare_inputs_padded`),
`num_rejected_tokens_gpu`, the sampled `next_token_ids` and `discard_request_mask`.

Worked example, one request, gamma2 = 3: the verification pass ran tokens
[t, d1, d2, d3] at positions 100..103 (q_len 4, seq_len 104); d1 was accepted, d2
rejected, so num_rejected = 2 and vLLM sampled a recovered token r at position 102.
committed = seq_len - num_rejected = 102: positions < 102 now hold exact KV (t, d1),
r is `next_token` at position `committed` and has no KV yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_triforce.core.verify import GREEDY_TEMPERATURE, sampling_probs


@dataclass
class StepBatch:
    req_ids: list[str]
    seq_lens: torch.Tensor       # [R] int64 tokens seen by the verification pass
    query_start_loc: torch.Tensor  # [R + 1] int64 rows of the verification pass
    num_rejected: torch.Tensor   # [R] int64
    decoding: torch.Tensor       # [R] bool: sampled a real token (not a partial prefill)
    next_tokens: torch.Tensor    # [R] int64
    block_table: torch.Tensor    # [R, max_blocks] int32 physical block ids
    verify_ids: torch.Tensor     # [num_tokens] int64 input ids of the verification pass
    temperature: torch.Tensor    # [R] float32 (0 for greedy rows)
    top_k: torch.Tensor | None   # [R] int64
    top_p: torch.Tensor | None   # [R] float32
    requests: list               # [R] vLLM CachedRequestState, for older token ids

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def q_lens(self) -> torch.Tensor:  # [R]
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def committed(self) -> torch.Tensor:  # [R] tokens with exact KV
        return self.seq_lens - self.num_rejected

    @property
    def verify_start(self) -> torch.Tensor:  # [R] first position of the verification pass
        return self.seq_lens - self.q_lens

    @property
    def greedy(self) -> torch.Tensor:  # [R] bool
        return self.temperature < GREEDY_TEMPERATURE

    def probs(self, logits: torch.Tensor, rows: torch.Tensor | int) -> torch.Tensor:
        """[n, V] logits -> the [n, V] distributions their requests' sampling params give:
        the same transform at every level (temperature, top-k, top-p; one-hot when greedy).
        `rows` [n]: the request row of each logits row (an int: all of one request). One
        call per pass, not per request: the vocabulary-wide work is batched."""
        n, device = logits.shape[0], logits.device
        rows = torch.as_tensor(rows, dtype=torch.long).expand(n)

        def per_token(values):
            return None if values is None else values[rows].to(device)

        return sampling_probs(logits.float(), per_token(self.temperature), per_token(self.top_k),
                              per_token(self.top_p))

    def token_ids(self, row: int, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of request `row` (end <= committed + 1)."""
        verify_start = int(self.verify_start[row])
        committed = int(self.committed[row])
        out = []
        request = self.requests[row]
        for pos in range(start, end):
            if pos == committed:
                out.append(int(self.next_tokens[row]))
            elif pos >= verify_start:
                out.append(int(self.verify_ids[self.query_start_loc[row] + pos - verify_start]))
            else:
                out.append(int(request.get_token_id(pos)))
        return out

    @classmethod
    def from_runner(cls, runner, cad, target_token_ids, next_token_ids, num_rejected_tokens_gpu,
                    sampling_metadata, block_size: int, max_lookahead: int) -> "StepBatch":
        """`max_lookahead`: positions past seq_len this step may touch (gamma2); the block
        table is copied only as wide as that needs, not max_model_len / block_size. Every
        device tensor comes to the host in ONE copy (`_to_host`): on a GPU each separate
        `.to("cpu")` would be a sync."""
        num_reqs = cad.num_reqs
        width = min(cad.block_table_tensor.shape[1],
                    (cad.max_seq_len + max_lookahead) // block_size + 1)
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        rejected = (torch.zeros(num_reqs, dtype=torch.long, device=next_token_ids.device)
                    if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:num_reqs])
        temperature = sampling_metadata.temperature
        if temperature is None:
            temperature = torch.zeros(num_reqs, device=next_token_ids.device)
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        host = _to_host([cad.seq_lens[:num_reqs], rejected, next_token_ids[:num_reqs],
                         cad.block_table_tensor[:num_reqs, :width], target_token_ids,
                         temperature[:num_reqs],
                         *(v[:num_reqs] for v in (top_k, top_p) if v is not None)])
        seq_lens, rejected, next_tokens, block_table, verify_ids, temperature, *rest = host
        top_k = rest.pop(0) if top_k is not None else None
        top_p = rest.pop(0) if top_p is not None else None
        discard = torch.as_tensor(runner.discard_request_mask.np[:num_reqs]).bool()
        return cls(
            req_ids=req_ids,
            seq_lens=seq_lens.long(),
            query_start_loc=cad.query_start_loc_cpu[: num_reqs + 1].to(torch.long),
            num_rejected=rejected.long(),
            decoding=~discard,
            next_tokens=next_tokens.long(),
            block_table=block_table.to(torch.int32),
            verify_ids=verify_ids.long(),
            temperature=temperature.float(),
            top_k=top_k,
            top_p=top_p,
            requests=[runner.requests[r] for r in req_ids],
        )


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors to the host in one transfer: packed as float64 (exact for token
    and block ids below 2**53 and for float32 values), split and cast back on the host."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out
