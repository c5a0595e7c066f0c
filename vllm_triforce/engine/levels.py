"""The proposer's step, level by level: commit, select, and the middle loop.

Terms. *committed*: positions whose KV is exact (written by vLLM's full-cache pass and
accepted). *middle tokens*: tokens accepted at level 2 this step, to be handed to vLLM
as drafts. A *round* is one level-1 proposal of up to gamma1 tokens followed by one
level-2 pass that verifies them and emits one more token (recovered or bonus).

Slots: vLLM reserves KV slots for `num_speculative_tokens` (= gamma2) lookahead
positions; a round never drafts past gamma2 middle tokens, so every pass here writes only
slots inside that reservation. Level-2 passes write approximate target KV into the real
slots of not-yet-verified positions; vLLM's next full pass rewrites those slots before
they are read, and summaries only ever take committed keys.
"""

from __future__ import annotations

import torch

from vllm_triforce.core.selection import (Selection, SelectionPolicy, build_block_tables,
                                          select_blocks)
from vllm_triforce.core.verify import verify
from vllm_triforce.engine import draft_level
from vllm_triforce.engine.forward import PassInputs, run_pass


# ---- 1. commit ------------------------------------------------------------------------
def commit(proposer, batch, states) -> None:
    """Fold the keys that became final this step into the block summaries."""
    bs = proposer.block_size
    rows, positions = [], []
    for r in range(batch.num_reqs):
        num_new = int(batch.q_lens[r] - batch.num_rejected[r])
        start = int(batch.verify_start[r])
        rows.append(batch.query_start_loc[r] + torch.arange(num_new))
        positions.append(start + torch.arange(num_new))
        states[r].invalidate_draft_from(start, proposer.blocks.draft_sink_blocks * bs)
        # This pass verified our drafts iff it ran at most the drafts we handed vLLM last
        # step after the newest token (the scheduler may trim them); a prefill chunk does not.
        num_verified = int(batch.q_lens[r]) - 1
        if 0 < num_verified <= states[r].last_num_drafts:
            accepted = num_verified - int(batch.num_rejected[r])
            proposer.stats.record_verification(num_verified, accepted)
            if not proposer.has_draft:  # two levels: the retrieval cache's drafts were judged
                proposer.refresh.record_round(states[r].refresh, num_verified, accepted)
        states[r].last_num_drafts = 0
    rows, positions = torch.cat(rows), torch.cat(positions)
    keys = proposer.capture.keys
    if rows.numel() == 0 or keys[0] is None:
        return
    req_of_row = torch.repeat_interleave(
        torch.arange(batch.num_reqs), (batch.q_lens - batch.num_rejected))
    block_ids = batch.block_table[req_of_row, positions // bs].long()
    proposer.summaries.add_committed(keys, rows, block_ids, positions % bs)


# ---- 2. select ------------------------------------------------------------------------
def last_committed_queries(proposer, batch, rows_idx: torch.Tensor) -> torch.Tensor:
    """[n, num_layers, Hq, D] query of each request's last committed token, per layer."""
    rows = (batch.query_start_loc[:-1] + batch.q_lens - batch.num_rejected - 1)[rows_idx]
    layer = proposer.target_layers[0]
    qs = [q.view(q.shape[0], layer.num_heads, layer.head_size)[rows.to(q.device)]
          for q in proposer.capture.queries]
    return torch.stack(qs, dim=1)


def refresh_selections(proposer, batch, states, decode_rows: list[int]) -> None:
    due = [r for r in decode_rows
           if states[r].logical_blocks is None
           or proposer.refresh.should_refresh(states[r].refresh, int(batch.committed[r]))]
    if proposer.capture.queries[0] is None:
        return
    rest = [r for r in decode_rows if r not in due]
    if rest and type(proposer.policy).observe is not SelectionPolicy.observe:  # h2o accumulates
        idx = torch.tensor(rest)
        proposer.policy.observe(last_committed_queries(proposer, batch, idx),
                                proposer.summaries, batch.block_table[idx].to(proposer.device),
                                batch.committed[idx], [states[r].policy_state for r in rest])
    if not due:
        return
    idx = torch.tensor(due)
    committed = batch.committed[idx]
    table = batch.block_table[idx].to(proposer.device)
    scores = proposer.policy.block_scores(
        last_committed_queries(proposer, batch, idx), proposer.summaries, table,
        committed.to(proposer.device), [states[r].policy_state for r in due])
    b = proposer.blocks
    sel = select_blocks(scores, committed.to(proposer.device), proposer.block_size,
                        b.budget_blocks, b.retrieval_sink_blocks, b.retrieval_recent_blocks)
    for i, r in enumerate(due):
        st = states[r]
        st.logical_blocks = sel.logical_blocks[i].cpu()
        st.num_selected = int(sel.num_selected[i])
        st.tail_start = int(sel.tail_start[i])
        proposer.refresh.record_selection(st.refresh, int(batch.committed[r]))
    proposer.stats.add(refreshes=len(due))


def _selection_of(states, rows: list[int]) -> Selection:
    return Selection(torch.stack([states[r].logical_blocks for r in rows]),
                     torch.tensor([states[r].num_selected for r in rows]),
                     torch.tensor([states[r].tail_start for r in rows]))


# ---- 3. the middle loop ---------------------------------------------------------------
class Round:
    """Per decoding request: the middle tokens so far and where the next input sits."""

    def __init__(self, last_token: int, position: int):
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []  # [V] each: the distribution the token came from
        self.last_token = last_token           # newest token, not yet in the target's KV
        self.position = position               # its position


def draft(proposer, batch, states, num_drafts: int, probs_buffer: torch.Tensor):
    """Run the hierarchy; returns drafts [R, num_drafts] and probs [R, num_drafts, V] (a view
    of `probs_buffer` [max_num_seqs, gamma2, V], preallocated and reserved) or None."""
    decode_rows = [r for r in range(batch.num_reqs) if bool(batch.decoding[r])]
    drafts = torch.zeros(batch.num_reqs, num_drafts, dtype=torch.long)
    if not decode_rows or num_drafts == 0:
        return drafts, None
    refresh_selections(proposer, batch, states, decode_rows)
    rounds = {r: Round(int(batch.next_tokens[r]), int(batch.committed[r])) for r in decode_rows}
    gamma1 = proposer.cfg.draft_tokens_per_round if proposer.has_draft else 0
    full_probs = (_full_cache_probs(proposer, batch, rounds, decode_rows)
                  if proposer.cfg.measure_middle_acceptance else None)
    while True:
        active = [r for r in decode_rows if len(rounds[r].tokens) < num_drafts]
        if not active:
            break
        sizes = [min(gamma1, num_drafts - len(rounds[r].tokens)) for r in active]
        _middle_round(proposer, batch, states, rounds, active, sizes)
        proposer.stats.add(middle_rounds=1)
        if full_probs is not None:  # first round: q at the first middle position
            q = torch.stack([rounds[r].probs[0] for r in decode_rows])
            proposer.stats.add(middle_pq_sum=float(torch.minimum(full_probs, q).sum()),
                               middle_pq_count=len(decode_rows))
            full_probs = None
    probs = None
    if not bool(batch.greedy[decode_rows].all()):
        probs = probs_buffer[:batch.num_reqs, :num_drafts]
        probs.zero_()
    for r in decode_rows:
        drafts[r] = torch.tensor(rounds[r].tokens[:num_drafts])
        states[r].last_num_drafts = num_drafts
        if probs is not None:
            probs[r] = torch.stack(rounds[r].probs[:num_drafts])
    return drafts, probs


def _middle_round(proposer, batch, states, rounds, active, sizes) -> None:
    if max(sizes) > 0:
        proposals, proposal_probs = draft_level.propose(proposer, batch, states, rounds,
                                                        active, sizes)
    else:
        proposals, proposal_probs = [[] for _ in active], None
    logits = _retrieval_pass(proposer, batch, states, rounds, active, proposals)
    rows = torch.tensor(active)
    num_inputs = torch.tensor([len(p) + 1 for p in proposals])  # [A] tokens per request
    target_probs = _per_request(batch.probs(logits, torch.repeat_interleave(rows, num_inputs)),
                                num_inputs)  # [A, max(sizes) + 1, V]
    draft_ids = torch.zeros(len(active), max(sizes), dtype=torch.long)
    for i, props in enumerate(proposals):
        draft_ids[i, :len(props)] = torch.tensor(props, dtype=torch.long)
    result = verify(draft_ids.to(logits.device), proposal_probs, target_probs,
                    (num_inputs - 1).to(logits.device), batch.greedy[rows].to(logits.device),
                    _generators(proposer, states, active))
    # the round's one device-to-host copy: [A, 1 + G + 1] = num_accepted, then the tokens
    host = torch.cat([result.num_accepted[:, None], result.output_token_ids], 1).tolist()
    for i, r in enumerate(active):
        accepted = host[i][0]
        _advance(proposer, states[r], rounds[r], host[i][1:accepted + 2], target_probs[i],
                 len(proposals[i]))


def _per_request(token_probs: torch.Tensor, num_inputs: torch.Tensor) -> torch.Tensor:
    """[T, V] rows of consecutive requests (num_inputs [A] each) -> [A, max, V], zero-padded."""
    owner = torch.repeat_interleave(torch.arange(num_inputs.numel()), num_inputs)  # [T]
    starts = torch.cumsum(num_inputs, 0) - num_inputs
    slot = torch.arange(owner.numel()) - starts[owner]  # [T] index inside its request
    out = token_probs.new_zeros(num_inputs.numel(), int(num_inputs.max()),
                                token_probs.shape[-1])
    device = token_probs.device
    out[owner.to(device), slot.to(device)] = token_probs
    return out


def _advance(proposer, state, rnd: Round, emitted: list[int], target_probs, num_proposed: int):
    """`emitted`: the round's accepted drafts then one recovered/bonus token; target_probs
    [max + 1, V] the distributions they were drawn from."""
    accepted = len(emitted) - 1
    rnd.tokens += emitted
    rnd.probs += list(target_probs[:accepted + 1])
    rnd.last_token = emitted[-1]
    rnd.position += accepted + 1
    if num_proposed:
        draft_level.after_round(proposer, state, rnd, num_proposed, accepted)
        proposer.refresh.record_round(state.refresh, num_proposed, accepted)
        proposer.stats.record_middle(num_proposed, accepted)


def _generators(proposer, states, rows):
    return [states[r].generator or proposer.generator for r in rows]


def _retrieval_pass(proposer, batch, states, rounds, active, proposals) -> torch.Tensor:
    """Level 2: the target over per-layer retrieval tables; logits of every input token."""
    bs = proposer.block_size
    ids, positions, qsl, ends = [], [], [0], []
    for r, props in zip(active, proposals):
        rnd = rounds[r]
        ids += [rnd.last_token] + list(props)
        positions += range(rnd.position, rnd.position + 1 + len(props))
        qsl.append(len(ids))
        ends.append(rnd.position + 1 + len(props))
    rows = torch.tensor(active)
    block_table = batch.block_table[rows]
    pos = torch.tensor(positions, dtype=torch.long)
    req_of = torch.repeat_interleave(torch.arange(len(active)), torch.diff(torch.tensor(qsl)))
    slots = block_table[req_of, pos // bs].long() * bs + pos % bs
    seq_ends = torch.tensor(ends, dtype=torch.long)
    tables, compact = build_block_tables(_selection_of(states, active), block_table, seq_ends, bs)
    inputs = PassInputs(input_ids=torch.tensor(ids, dtype=torch.int32), positions=pos,
                        slot_mapping=slots, query_start_loc=torch.tensor(qsl),
                        seq_lens=compact[0], sample_rows=torch.arange(len(ids)))
    per_layer = {name: tables[l] for l, name in enumerate(proposer.target_layer_names)}
    return run_pass(proposer.target_model, proposer.vllm_config, _target_groups(proposer),
                    inputs, per_layer, proposer.device, proposer.stats)


def _full_cache_probs(proposer, batch, rounds, rows: list[int]) -> torch.Tensor:
    """[len(rows), V]: the target over its FULL cache at each request's first middle position
    (input: the newest token; every earlier position is committed, so this is exactly the
    distribution vLLM's verification will use there). Diagnostic for
    `measure_middle_acceptance`. It writes the newest token's exact KV into its slot; the
    retrieval pass that follows overwrites that slot as it always does."""
    bs = proposer.block_size
    idx = torch.tensor(rows)
    block_table = batch.block_table[idx]
    pos = torch.tensor([rounds[r].position for r in rows], dtype=torch.long)
    slots = block_table[torch.arange(len(rows)), pos // bs].long() * bs + pos % bs
    inputs = PassInputs(input_ids=torch.tensor([rounds[r].last_token for r in rows],
                                               dtype=torch.int32),
                        positions=pos, slot_mapping=slots,
                        query_start_loc=torch.arange(len(rows) + 1),
                        seq_lens=pos + 1, sample_rows=torch.arange(len(rows)))
    per_layer = dict.fromkeys(proposer.target_layer_names, block_table)
    logits = run_pass(proposer.target_model, proposer.vllm_config, _target_groups(proposer),
                      inputs, per_layer, proposer.device, proposer.stats)
    return batch.probs(logits, torch.tensor(rows))


def _target_groups(proposer):
    return [g for groups in proposer.runner.attn_groups for g in groups]
