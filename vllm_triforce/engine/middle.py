"""The middle loop: rounds of level 1 proposing and level 2 verifying, then the hand-off.

Terms. *middle tokens*: tokens accepted at level 2 this step, to be handed to vLLM as
drafts. A *round* is one level-1 proposal of up to gamma1 tokens per request followed by one
level-2 pass that verifies them and emits one more token (recovered or bonus). With gamma1 = 0
(no small draft, or the small draft off this step) a round is the retrieval level drafting by
itself: one token per request, sampled from its distribution.

Worked example, gamma1 = 2, num_drafts = [3, 0, 5] for decoding rows [0, 2, 5]: row 2 does no
middle work; round 1 proposes 2 tokens for rows 0 and 5 and each keeps the accepted ones plus
one (say row 0 holds 3, row 5 holds 1); round 2 runs only row 5 (2 proposals); and so on until
every row holds its count. A row may hold more than asked (a round emits up to gamma1 + 1
tokens); the hand-off takes the first num_drafts.
"""

from __future__ import annotations

import time

import torch

from vllm_triforce.core.verify import verify, verify_greedy


class RequestDrafts:
    """One decoding request's middle tokens, gathered over all the middle rounds of a step,
    and where its next input sits."""

    def __init__(self, last_token: int, position: int):
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []  # [V] each: the distribution the token came from
        # (kept empty in an all-greedy step: nobody reads it)
        self.last_token = last_token           # newest token, not yet in the target's KV
        self.position = position               # its position
        self.query_row = -1  # row, in the last level-2 pass, of the token before last_token


class MiddleLoop:
    """Runs `retrieval` (level 2), with `draft` (level 1, None in two-level mode) proposing
    `gamma1` tokens per round; `refresh` hears every round's acceptance, `stats` counts, and
    `generator` samples for requests without a seed of their own."""

    def __init__(self, retrieval, draft, gamma1: int, refresh, stats,
                 generator: torch.Generator, measure_middle_acceptance: bool):
        self.retrieval = retrieval
        self.draft = draft
        self.gamma1 = gamma1 if draft is not None else 0
        self.refresh = refresh
        self.stats = stats
        self.generator = generator
        self.measure = measure_middle_acceptance

    def run(self, batch, states, rows: list[int], num_drafts: list[int],
            use_draft: bool = True, on_round=None) -> dict[int, RequestDrafts]:
        """Middle tokens for decoding `rows`: rows[i] gets at least num_drafts[i] (0: no middle
        work at all). `use_draft` False: the small draft sits out (gamma1 = 0 this step).
        `on_round(use_draft, num_active, seconds, tokens_per_request)` hears every round's
        wall time (it ends in a device-to-host copy, so device work is included)."""
        drafts_by_row = {r: RequestDrafts(int(batch.next_tokens[r]), int(batch.committed[r]))
                         for r in rows}
        wanted = dict(zip(rows, num_drafts))
        gamma1 = self.gamma1 if use_draft else 0
        measured = [r for r in rows if wanted[r] > 0]
        full_probs = (self._full_cache_probs(batch, drafts_by_row, measured) if self.measure
                      else None)
        # every row greedy: vLLM gets no draft probs and a round needs only argmaxes
        argmax_only = not self.measure and bool(batch.greedy[rows].all())
        while True:
            active = [r for r in rows if len(drafts_by_row[r].tokens) < wanted[r]]
            if not active:
                return drafts_by_row
            sizes = [min(gamma1, wanted[r] - len(drafts_by_row[r].tokens)) for r in active]
            start = time.perf_counter()
            emitted = self._round(batch, states, drafts_by_row, active, sizes, argmax_only)
            more = [r for r in active if len(drafts_by_row[r].tokens) < wanted[r]]
            if more:  # next round's blocks, from the newest middle tokens' queries
                self.retrieval.select_in_middle(batch, states, more, drafts_by_row)
            if on_round is not None:
                on_round(gamma1 > 0, len(active), time.perf_counter() - start,
                         emitted / len(active))
            self.stats.add(middle_rounds=1)
            if full_probs is not None:  # first round: q at the first middle position
                q = torch.stack([drafts_by_row[r].probs[0] for r in measured])
                self.stats.add(middle_pq_sum=float(torch.minimum(full_probs, q).sum()),
                               middle_pq_count=len(measured))
                full_probs = None

    def _full_cache_probs(self, batch, drafts_by_row, rows: list[int]):
        if not rows:
            return None
        return self.retrieval.full_cache_probs(
            batch, rows, [drafts_by_row[r].last_token for r in rows],
            [drafts_by_row[r].position for r in rows])

    def _round(self, batch, states, drafts_by_row, active: list[int], sizes: list[int],
               argmax_only: bool = False) -> int:
        """One round for requests `active`, request active[i] proposing sizes[i] tokens;
        returns the middle tokens it added over all of them. `argmax_only`: every request
        is greedy and nobody reads the middle distributions (RequestDrafts.probs stays
        empty)."""
        if max(sizes) > 0:
            proposals, proposal_probs = self.draft.propose(batch, states, drafts_by_row,
                                                           active, sizes)
        else:
            proposals, proposal_probs = [[] for _ in active], None
        logits = self.retrieval.forward(
            batch, states, active,
            [[drafts_by_row[r].last_token] + p for r, p in zip(active, proposals)],
            [list(range(drafts_by_row[r].position, drafts_by_row[r].position + 1 + len(p)))
             for r, p in zip(active, proposals)])
        rows = torch.tensor(active)
        num_inputs = torch.tensor([len(p) + 1 for p in proposals])  # [A] tokens per request
        draft_ids = torch.zeros(len(active), max(sizes), dtype=torch.long)
        for i, props in enumerate(proposals):
            draft_ids[i, :len(props)] = torch.tensor(props, dtype=torch.long)
        device = logits.device
        if argmax_only:  # no vocabulary-wide probabilities at all
            target_probs = None
            argmax = _per_request(logits.argmax(-1, keepdim=True), num_inputs)[..., 0]
            result = verify_greedy(draft_ids.to(device), argmax, (num_inputs - 1).to(device))
        else:
            target_probs = _per_request(
                batch.probs(logits, torch.repeat_interleave(rows, num_inputs)),
                num_inputs)  # [A, max(sizes) + 1, V]
            result = verify(draft_ids.to(device), proposal_probs, target_probs,
                            (num_inputs - 1).to(device), batch.greedy[rows],
                            [states[r].generator or self.generator for r in active])
        # the round's one device-to-host copy: [A, 1 + G + 1] = num_accepted, then the tokens
        host = torch.cat([result.num_accepted[:, None], result.output_token_ids], 1).tolist()
        first_rows = (torch.cumsum(num_inputs, 0) - num_inputs).tolist()  # [A] in the pass
        for i, r in enumerate(active):
            accepted = host[i][0]
            drafts_by_row[r].query_row = first_rows[i] + accepted  # input `accepted`: newest kept
            self._advance(states[r], drafts_by_row[r], host[i][1:accepted + 2],
                          None if target_probs is None else target_probs[i], len(proposals[i]))
        return sum(row[0] + 1 for row in host)

    def _advance(self, state, drafts: RequestDrafts, emitted: list[int], target_probs,
                 num_proposed: int) -> None:
        """`emitted`: the round's accepted drafts then one recovered/bonus token; target_probs
        [max + 1, V] the distributions they were drawn from (None: argmax only)."""
        accepted = len(emitted) - 1
        drafts.tokens += emitted
        if target_probs is not None:
            drafts.probs += list(target_probs[:accepted + 1])
        drafts.last_token = emitted[-1]
        drafts.position += accepted + 1
        if num_proposed:
            self.draft.after_round(state, drafts, num_proposed, accepted)
            self.refresh.record_round(state.refresh, num_proposed, accepted)
            self.stats.record_middle(num_proposed, accepted)


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


def hand_off(batch, states, drafts_by_row: dict[int, RequestDrafts], depths: dict[int, int],
             probs_buffer: torch.Tensor):
    """What vLLM gets: one draft list per request (`depths[r]` tokens for decoding row r,
    [] for the others) and, unless every drafting row is greedy, their probs
    [R, max depth, V], zero-padded: a view of `probs_buffer` [max_num_seqs, gamma2, V],
    preallocated and reserved (engine/memory.py). vLLM reads row r's first len(drafts[r])
    entries. Each row must hold at least its depth in middle tokens."""
    drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
    drafting = [r for r, k in depths.items() if k > 0]
    probs = None
    if drafting and not bool(batch.greedy[drafting].all()):
        probs = probs_buffer[:batch.num_reqs, :max(depths.values())]
        probs.zero_()
    for r, k in depths.items():
        drafts[r] = drafts_by_row[r].tokens[:k]
        states[r].last_num_drafts = k
        if probs is not None and k:
            probs[r, :k] = torch.stack(drafts_by_row[r].probs[:k])
    return drafts, probs
