"""Level 1: the small draft over its StreamingLLM block table (core/streaming.py).

The draft's KV lives in the same paged blocks as the target's (its layers are extra
layers of the same KV-cache group), so its StreamingLLM cache is just a compacted table:
the request's sink blocks plus its last `draft_window_blocks` blocks. Its keys are cached
after RoPE at *rebased* positions, so it never sees a position past its trained context.

Per request we track `draft_valid_upto`: the draft KV at positions [window_start, it) is
current. A round first runs the draft over the *pending* tokens (everything after that
point up to the newest token; plus the sinks the first time, or the whole window after a
rebase) and samples e_1, then single-token steps sample e_2..e_g.
"""

from __future__ import annotations

import torch

from vllm_triforce.core.streaming import draft_positions, needs_rebase, streaming_table, window_start
from vllm_triforce.engine.forward import PassInputs, run_pass


def propose(proposer, batch, states, rounds, active, sizes):
    """Returns proposals (list of token lists, len(active)) and their probs [n, G, V]."""
    max_size = max(sizes)
    proposals = [[] for _ in active]
    probs = None
    pending = [_pending_tokens(proposer, batch, states[r], rounds[r], r, sizes[i])
               for i, r in enumerate(active)]
    for step in range(max_size):
        rows = [i for i in range(len(active)) if sizes[i] > step]
        if step == 0:
            chunks = [pending[i] for i in rows]
        else:
            chunks = [([rounds[active[i]].position + step], [proposals[i][-1]]) for i in rows]
        reqs = [active[i] for i in rows]
        logits = _draft_pass(proposer, batch, states, reqs, chunks)
        q = batch.probs(logits, torch.tensor(reqs))  # [len(rows), V]
        tokens = _sample(q, batch.greedy[reqs], [states[r].generator for r in reqs],
                         proposer.generator)
        if probs is None:
            probs = q.new_zeros(len(active), max_size, q.shape[-1])
        probs[torch.tensor(rows, device=q.device), step] = q
        for i, token in zip(rows, tokens):
            proposals[i].append(token)
    for i, r in enumerate(active):  # the pending tokens now hold current draft KV
        states[r].draft_valid_upto = rounds[r].position + 1
        states[r].draft_sinks_valid = True
    return proposals, probs


def after_round(proposer, state, rnd, num_proposed: int, num_accepted: int) -> None:
    """Proposals e_1..e_{g-1} were draft inputs; those accepted keep valid draft KV."""
    round_start = rnd.position - num_accepted - 1  # position of the round's first input
    state.draft_valid_upto = round_start + 1 + min(num_accepted, num_proposed - 1)


def _pending_tokens(proposer, batch, state, rnd, row: int, size: int):
    """(positions, token ids) the draft must run before sampling e_1 for one request."""
    bs = proposer.block_size
    b = proposer.blocks
    sink_tokens = b.draft_sink_blocks * bs
    end = rnd.position + 1  # tokens through the newest one
    start = int(window_start(torch.tensor([end]), bs, b.draft_sink_blocks,
                             b.draft_window_blocks)[0])
    max_position = torch.tensor([rnd.position + size])
    max_draft = proposer.draft_model_config.hf_config.max_position_embeddings
    if bool(needs_rebase(max_position, torch.tensor([state.draft_rebase_offset]),
                         sink_tokens, max_draft)[0]):
        state.draft_rebase_offset = max(start - sink_tokens, 0)
        state.draft_valid_upto = 0
        proposer.stats.add(draft_rebases=1)
    positions = []
    if not state.draft_sinks_valid:
        positions += range(0, min(sink_tokens, end))
    positions += range(max(state.draft_valid_upto, start, len(positions)), end)
    return positions, _token_ids(batch, rnd, row, positions)


def _token_ids(batch, rnd, row: int, positions: list[int]) -> list[int]:
    """Ids at committed positions come from vLLM; later ones are this step's middle tokens."""
    committed_end = int(batch.committed[row]) + 1  # next_token included
    out = []
    for pos in positions:
        if pos < committed_end:
            out.extend(batch.token_ids(row, pos, pos + 1))
        else:
            out.append(rnd.tokens[pos - committed_end])
    return out


def _draft_pass(proposer, batch, states, rows: list[int], chunks) -> torch.Tensor:
    """One forward of the small draft; logits at the last token of each request."""
    bs = proposer.block_size
    b = proposer.blocks
    ids, positions, qsl, ends, offsets = [], [], [0], [], []
    for r, (pos, toks) in zip(rows, chunks):
        ids += toks
        positions += pos
        qsl.append(len(ids))
        ends.append(pos[-1] + 1)
        offsets += [states[r].draft_rebase_offset] * len(pos)
    block_table = batch.block_table[torch.tensor(rows)]
    pos = torch.tensor(positions, dtype=torch.long)
    req_of = torch.repeat_interleave(torch.arange(len(rows)), torch.diff(torch.tensor(qsl)))
    slots = block_table[req_of, pos // bs].long() * bs + pos % bs
    table, compact = streaming_table(block_table, torch.tensor(ends), b.draft_sink_blocks,
                                     b.draft_window_blocks, bs)
    inputs = PassInputs(
        input_ids=torch.tensor(ids, dtype=torch.int32),
        positions=draft_positions(pos, torch.tensor(offsets), b.draft_sink_blocks * bs),
        slot_mapping=slots, query_start_loc=torch.tensor(qsl), seq_lens=compact,
        sample_rows=torch.tensor(qsl[1:]) - 1)
    return run_pass(proposer.model, proposer.vllm_config, proposer.draft_attn_groups, inputs,
                    table, proposer.device, proposer.stats)


def _sample(q: torch.Tensor, greedy: torch.Tensor, own_generators: list,
            shared: torch.Generator) -> list[int]:
    """One token per row of q [n, V]: argmax for greedy rows; a draw for the others, with
    the request's own generator (seeded requests: reproducible whatever the batch) or one
    batched draw from the shared generator. One device-to-host copy for the whole batch."""
    tokens = q.argmax(-1)  # [n]
    unseeded = [j for j, g in enumerate(own_generators) if g is None and not bool(greedy[j])]
    if unseeded:
        idx = torch.tensor(unseeded, device=q.device)
        tokens[idx] = torch.multinomial(q[idx], 1, generator=shared).squeeze(1)
    for j, g in enumerate(own_generators):
        if g is not None and not bool(greedy[j]):
            tokens[j] = torch.multinomial(q[j], 1, generator=g)[0]
    return tokens.tolist()
