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

import itertools
import time

import torch

from vllm_triforce.core.verify import GREEDY_TEMPERATURE, sample_tokens, verify, verify_greedy
from vllm_triforce.engine.transfer import to_device


class RequestDrafts:
    """One decoding request's middle tokens, gathered over all the middle rounds of a step,
    and where its next input sits."""

    def __init__(self, last_token: int, position: int):
        self.tokens: list[int] = []
        self.last_token = last_token           # newest token, not yet in the target's KV
        self.position = position               # its position
        self.query_row = -1  # row, in the last level-2 pass, of the token before last_token


class MiddleLoop:
    """Runs a step of the retrieval level (level 2, engine/retrieval_level.RetrievalStep),
    with `draft` (level 1, None in two-level mode) proposing `gamma1` tokens per round
    (engine/shape.py: 0 without a small draft); `refresh` hears every round's acceptance,
    `stats` counts, and `generator` samples for requests without a seed of their own.

    `on_round_start`: a seam for profilers (tools/bench/syncs.py), called as each round starts
    (None: nothing)."""

    def __init__(self, draft, gamma1: int, refresh, stats, generator: torch.Generator,
                 measure_middle_acceptance: bool):
        self.draft = draft
        self.gamma1 = gamma1
        self.refresh = refresh
        self.stats = stats
        self.generator = generator
        self.measure = measure_middle_acceptance
        self.on_round_start = None

    def run(self, step, rows: list[int], num_drafts: list[int], probs_out: torch.Tensor,
            use_draft: bool = True, on_round=None) -> dict[int, RequestDrafts]:
        """Middle tokens for decoding `rows` of the retrieval level's `step` (its batch and
        request states): rows[i] gets at least num_drafts[i] (0: no middle
        work at all). `probs_out` [at least the drafting rows, gamma2, V] (the reserved buffer
        `hand_off` gives vLLM): the k-th middle token's distribution of the i-th drafting row
        (`drafting_slots`) goes to probs_out[i, k] as the round that emits it ends (k < gamma2;
        nothing is written when every row is greedy and measure_middle_acceptance is off),
        so no round's distributions stay alive after it. `use_draft` False: the small draft
        sits out (gamma1 = 0 this step).
        `on_round(use_draft, num_active, seconds, tokens_per_request)` hears every round's
        wall time (it ends in a device-to-host copy, so device work is included)."""
        batch, states = step.batch, step.states
        drafts_by_row = {r: RequestDrafts(batch.next_tokens[r], batch.committed[r])
                         for r in rows}
        wanted = dict(zip(rows, num_drafts))
        gamma1 = self.gamma1 if use_draft else 0
        slots = drafting_slots(wanted)
        measured = list(slots)
        full_probs = (self._full_cache_probs(step, drafts_by_row, measured) if self.measure
                      else None)
        # every row greedy: vLLM gets no draft probs and a round needs only argmaxes
        argmax_only = not self.measure and all(batch.greedy[r] for r in rows)
        while True:
            active = [r for r in rows if len(drafts_by_row[r].tokens) < wanted[r]]
            if not active:
                return drafts_by_row
            sizes = [min(gamma1, wanted[r] - len(drafts_by_row[r].tokens)) for r in active]
            if self.on_round_start is not None:
                self.on_round_start()
            start = time.perf_counter()
            emitted = self._round(step, drafts_by_row, active, sizes, slots,
                                  None if argmax_only else probs_out)
            more = [r for r in active if len(drafts_by_row[r].tokens) < wanted[r]]
            if more:  # next round's blocks, from the newest middle tokens' queries
                step.select_in_middle(more, drafts_by_row)
            if on_round is not None:
                on_round(gamma1 > 0, len(active), time.perf_counter() - start,
                         emitted / len(active))
            self.stats.add(middle_rounds=1)
            if full_probs is not None:  # first round: q at the first middle position
                q = probs_out[:len(measured), 0]  # the measured rows are the first slots
                self.stats.add(middle_pq_sum=float(torch.minimum(full_probs, q).sum()),
                               middle_pq_count=len(measured))
                full_probs = None

    @staticmethod
    def _full_cache_probs(step, drafts_by_row, rows: list[int]):
        if not rows:
            return None
        return step.full_cache_probs(rows, [drafts_by_row[r].last_token for r in rows],
                                     [drafts_by_row[r].position for r in rows])

    def _round(self, step, drafts_by_row, active: list[int], sizes: list[int],
               slots: dict[int, int], probs_out: torch.Tensor | None) -> int:
        """One round for requests `active`, request active[i] proposing sizes[i] tokens;
        returns the middle tokens it added over all of them. `probs_out` None: every
        request is greedy and nobody reads the middle distributions (argmax only); else
        `run`'s buffer, request r's rows at slots[r]. Everything stays on the device until
        the round's one device-to-host copy of what decides the next round: accepted counts
        and emitted tokens."""
        batch, states = step.batch, step.states
        argmax_only = probs_out is None
        proposals, proposal_probs = None, None  # [A, max(sizes)] and [A, max(sizes), V]
        if max(sizes) > 0:
            proposals, proposal_probs = self.draft.propose(batch, states, drafts_by_row,
                                                           active, sizes)
        num_inputs = [size + 1 for size in sizes]  # [A] the newest token, then the proposals
        first_rows = [0, *itertools.accumulate(num_inputs)][:-1]  # [A] in the pass
        logits = step.forward(
            active, self._input_ids(drafts_by_row, active, proposals, sizes, first_rows),
            [list(range(drafts_by_row[r].position, drafts_by_row[r].position + n))
             for r, n in zip(active, num_inputs)])
        if argmax_only and proposals is None:  # one token per request: its argmax, kept
            host = [[0, token] for token in logits.argmax(-1).tolist()]  # the one copy
            for i, r in enumerate(active):
                drafts_by_row[r].query_row = first_rows[i]
                self._advance(states[r], drafts_by_row[r], host[i][1:], sizes[i])
            return len(active)
        if proposals is None:  # the level drafts alone, one token per request: drawn from p
            rows = batch.rows_on_device(active)
            target_probs = batch.probs(logits, active, rows)[:, None]  # [A, 1, V]
            tokens = sample_tokens(target_probs[:, 0],
                                   batch.temperature[rows] < GREEDY_TEMPERATURE,
                                   [states[r].generator for r in active], self.generator)
            # what `verify` of no drafts draws, in a dozen operations instead of ~55
            host = [[0, token] for token in tokens.tolist()]  # the round's one copy
        else:
            target_probs, result = self._verify(batch, states, active, sizes, logits,
                                                num_inputs, proposals, proposal_probs,
                                                argmax_only)
            # the round's one device-to-host copy: [A, 1 + G + 1] = num_accepted, then tokens
            host = torch.cat([result.num_accepted[:, None], result.output_token_ids],
                             1).tolist()
        if target_probs is not None:  # each row's new middle tokens' distributions
            self._keep_probs(drafts_by_row, active, [row[0] + 1 for row in host], target_probs,
                             [slots[r] for r in active], probs_out)
        for i, r in enumerate(active):
            accepted = host[i][0]
            drafts_by_row[r].query_row = first_rows[i] + accepted  # input `accepted`: newest kept
            self._advance(states[r], drafts_by_row[r], host[i][1:accepted + 2], sizes[i])
        return sum(row[0] + 1 for row in host)

    def _verify(self, batch, states, active: list[int], sizes: list[int], logits,
                num_inputs: list[int], proposals, proposal_probs, argmax_only: bool):
        """The retrieval level's verification of the small draft's proposals: (target probs
        [A, max(sizes) + 1, V], or None with `argmax_only`, and the VerifyResult)."""
        device, shape = logits.device, (len(active), max(num_inputs))
        owner = [i for i, n in enumerate(num_inputs) for _ in range(n)]  # [T] request index
        slot = [j for n in num_inputs for j in range(n)]  # [T] input index in its request
        rows, num_drafts, owner, slot = to_device(device, active, sizes, owner, slot)
        if argmax_only:  # no vocabulary-wide probabilities at all: nobody reads them
            argmax = logits.argmax(-1, keepdim=True)  # [T, 1]
            if shape[1] > 1:  # else one token per request: already [A, 1]
                argmax = _per_request(argmax, shape, owner, slot)[..., 0]
            return None, verify_greedy(proposals, argmax, num_drafts)
        token_rows = [r for r, n in zip(active, num_inputs) for _ in range(n)]
        target_probs = _per_request(batch.probs(logits, token_rows), shape, owner,
                                    slot)  # [A, max(sizes) + 1, V]
        return target_probs, verify(proposals, proposal_probs, target_probs, num_drafts,
                                    batch.temperature[rows] < GREEDY_TEMPERATURE,
                                    [states[r].generator or self.generator for r in active],
                                    all_greedy=all(batch.greedy[r] for r in active))

    @staticmethod
    def _keep_probs(drafts_by_row, active: list[int], emitted: list[int],
                    target_probs: torch.Tensor, slots: list[int],
                    probs_out: torch.Tensor) -> None:
        """Copy request active[i]'s first emitted[i] rows of target_probs [A, width, V] to
        probs_out[slots[i], k, :] after its earlier middle tokens (k < gamma2), with one
        index copy: the round's tensors are freed when the round ends."""
        gamma2 = probs_out.shape[1]
        src, dst_row, dst_slot = [], [], []
        width = target_probs.shape[1]
        for i, (r, n, slot) in enumerate(zip(active, emitted, slots)):
            first = len(drafts_by_row[r].tokens)
            for j in range(min(n, gamma2 - first)):
                src.append(i * width + j)
                dst_row.append(slot)
                dst_slot.append(first + j)
        if src:
            src, dst_row, dst_slot = to_device(probs_out.device, src, dst_row, dst_slot)
            probs_out[dst_row, dst_slot] = target_probs.flatten(0, 1)[src]

    @staticmethod
    def _input_ids(drafts_by_row, active: list[int], proposals, sizes: list[int],
                   first_rows: list[int]):
        """The round's input ids: per request its newest token, then its proposals. Without
        proposals a list per request (host values); with them one flat device tensor
        [sum(sizes) + A], assembled on the device (the host never reads the proposals)."""
        last_tokens = [drafts_by_row[r].last_token for r in active]
        if proposals is None:
            return [[token] for token in last_tokens]
        width = proposals.shape[1]
        into = [first + 1 + j for first, size in zip(first_rows, sizes) for j in range(size)]
        taken = [i * width + j for i, size in enumerate(sizes) for j in range(size)]
        firsts, lasts, into, taken = to_device(proposals.device, first_rows, last_tokens,
                                               into, taken)
        ids = proposals.new_empty(sum(sizes) + len(active))
        ids[firsts] = lasts
        ids[into] = proposals.reshape(-1)[taken]
        return ids

    def _advance(self, state, drafts: RequestDrafts, emitted: list[int],
                 num_proposed: int) -> None:
        """`emitted`: the round's accepted drafts then one recovered/bonus token."""
        accepted = len(emitted) - 1
        drafts.tokens += emitted
        drafts.last_token = emitted[-1]
        drafts.position += accepted + 1
        if num_proposed:
            self.draft.after_round(state, drafts, num_proposed, accepted)
            self.refresh.record_round(state.refresh, num_proposed, accepted)
            self.stats.record_middle(num_proposed, accepted)


def _per_request(token_rows: torch.Tensor, shape: tuple[int, int], owner: torch.Tensor,
                 slot: torch.Tensor) -> torch.Tensor:
    """[T, V] rows of consecutive requests -> [A, width, V] (shape = (A, width)),
    zero-padded: token t goes to [owner[t], slot[t]] (owner, slot [T] on the device, built
    by the host)."""
    out = token_rows.new_zeros(*shape, token_rows.shape[-1])
    out[owner, slot] = token_rows
    return out


def drafting_slots(depths: dict[int, int]) -> dict[int, int]:
    """Row -> its row in the hand-off buffer: the drafting rows (depth > 0), in order.
    Example: {0: 3, 2: 0, 5: 6} -> {0: 0, 5: 1}."""
    return {r: i for i, r in enumerate(r for r, k in depths.items() if k > 0)}


def hand_off(batch, states, drafts_by_row: dict[int, RequestDrafts], depths: dict[int, int],
             probs_buffer: torch.Tensor):
    """What vLLM gets: one draft list per request (`depths[r]` tokens for decoding row r,
    [] for the others) and, unless every drafting row is greedy, their probs
    [D, max depth, V] with the request ids of its D rows: a view of `probs_buffer`
    [MAX_DRAFTING_REQUESTS or fewer, gamma2, V], preallocated and reserved (engine/memory.py),
    which `MiddleLoop.run` filled by `drafting_slots`. vLLM finds a request's row by its id
    and reads its first len(drafts[r]) entries (vllm/v1/worker/gpu_model_runner.py,
    `_get_spec_decode_draft_probs`, 0.32.0; the `handoff_rows` patch hands it these ids);
    the others are not cleared. Each row must hold at least its depth in middle tokens."""
    drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
    slots = drafting_slots(depths)
    probs, req_ids = None, None
    if slots and not all(batch.greedy[r] for r in slots):
        probs = probs_buffer[:len(slots), :max(depths.values())]
        req_ids = [batch.req_ids[r] for r in slots]
    for r, k in depths.items():
        drafts[r] = drafts_by_row[r].tokens[:k]
        states[r].last_num_drafts = k
    return drafts, probs, req_ids
