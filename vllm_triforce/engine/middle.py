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

Memory and host work at serving batch sizes. A round's pass returns the logits of every
request at once, but what follows over the vocabulary (distributions, verification, draws,
the copy into the hand-off buffer) runs on chunks of at most MIDDLE_CHUNK_ROWS token rows
(engine/buffers.py `middle_chunk_requests`), so its temporaries are a fixed amount whatever
the batch (engine/buffers.py `vocabulary_rows`); one chunk holds up to 64 requests of one
token, so the chunking costs nothing below that. Each chunk writes its rows into the
hand-off buffer on the device, before the round's one copy to the host: the rows a
request did not emit go to the buffer's spare row (`HandOffBuffer`), so no host list
decides them. What the host builds per round is one list per request at most (positions,
sizes), never a Python loop per token row of the vocabulary work.
"""

from __future__ import annotations

import functools
import operator
import time

import numpy as np
import torch

from vllm_triforce.core.verify import (GREEDY_TEMPERATURE, draw_uniforms, sample_tokens, verify,
                                       verify_greedy)
from vllm_triforce.engine.batch import of_rows
from vllm_triforce.engine.buffers import middle_chunk_requests
from vllm_triforce.engine.device.forward import Runs
from vllm_triforce.engine.device.transfer import to_device
from vllm_triforce.engine.mrv2.draft_logits import keep_logits


class HandOffBuffer:
    """The draft probabilities vLLM gets, reserved once: `rows` [D, gamma2, V] float32 (as
    vLLM's rejection sampler reads them), one row per request that may draft (the drafting
    cap), and one spare row after them in the same allocation, where a round's writes of
    rows a request did not emit land (`MiddleLoop._keep_probs`)."""

    def __init__(self, drafting: int, gamma2: int, vocab_size: int, device=None):
        # drafting 0: no probabilities are handed (Model Runner V2 takes `logits`)
        self.flat = (torch.zeros(drafting * gamma2 + 1, vocab_size, dtype=torch.float32,
                                 device=device) if drafting else None)  # [D * gamma2 + 1, V]
        self.rows = (self.flat[:-1].view(drafting, gamma2, vocab_size) if drafting
                     else None)
        self.spare = drafting * gamma2  # the spare row's index in `flat`
        self.gamma2 = gamma2
        # Model Runner V2's draft logits by request slot (engine/mrv2/draft_logits.py),
        # written beside the probabilities: the logits each middle token was drawn from
        self.logits = None

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes if self.flat is not None else 0


class RequestDrafts:
    """One decoding request's middle tokens, gathered over all the middle rounds of a step,
    and where its next input sits (a row of `MiddleDrafts`, for code that reads one request
    at a time)."""

    def __init__(self, last_token: int, position: int):
        self.tokens: list[int] = []
        self.last_token = last_token           # newest token, not yet in the target's KV
        self.position = position               # its position
        self.query_row = -1  # row, in the last level-2 pass, of the token before last_token


class MiddleDrafts:
    """The middle tokens of a step's decoding rows, gathered over its rounds, as host arrays
    (numpy: a round updates every request at once, no Python loop per request), and where
    each row's next input sits. Entry i is decoding row rows[i]; `drafts[row]` is a copy of
    one row as a `RequestDrafts`, for the code that reads one request at a time."""

    def __init__(self, rows: list[int], wanted: list[int], last_tokens: np.ndarray,
                 positions: np.ndarray, width: int):
        self.rows = np.asarray(rows, dtype=np.int64)         # [n] batch rows
        self.wanted = np.asarray(wanted, dtype=np.int64)     # [n] middle tokens asked for
        self.count = np.zeros(len(rows), dtype=np.int64)     # [n] middle tokens held
        self.tokens = np.zeros((len(rows), width), dtype=np.int64)  # [n, width]
        self.last_token = np.array(last_tokens, dtype=np.int64)  # [n] see RequestDrafts
        self.position = np.array(positions, dtype=np.int64)      # [n]
        self.query_row = np.full(len(rows), -1, dtype=np.int64)  # [n]
        # [n] each row's hand-off slot: the drafting rows (wanted > 0), in order
        self.slot = np.cumsum(self.wanted > 0) - 1
        # batch row -> entry (-1: not a decoding row)
        self._index = np.full(int(self.rows.max(initial=-1)) + 1, -1, dtype=np.int64)
        self._index[self.rows] = np.arange(len(rows))

    def live(self) -> np.ndarray:
        """Indices of the rows that still want middle tokens."""
        return np.flatnonzero(self.count < self.wanted)

    def advance(self, live: np.ndarray, host: np.ndarray, first_rows: np.ndarray) -> None:
        """Rows `live` after a round: host [A, 1 + G + 1] (accepted drafts, then the emitted
        tokens, -1 padded), first_rows [A] each one's first row in the round's pass.
        Example, a row holding 2 tokens that accepted 1 draft [a] and emitted [a, r]:
        tokens[2:4] = [a, r], count 4, last_token r, position + 2, query_row first + 1."""
        if host.shape[1] == 2:  # one token each, no draft to accept (G = 0)
            self.advance_one(live, host[:, 1])
            return
        accepted = host[:, 0]
        emitted = accepted + 1
        offset = np.arange(host.shape[1] - 1)
        kept = offset < emitted[:, None]  # [A, G + 1]
        owner = np.repeat(live, emitted)
        self.tokens[owner, (self.count[live][:, None] + offset)[kept]] = host[:, 1:][kept]
        self.last_token[live] = host[np.arange(len(live)), emitted]
        self.position[live] += emitted
        self.count[live] += emitted
        self.query_row[live] = first_rows + accepted  # input `accepted`: the newest kept

    def advance_one(self, live: np.ndarray, tokens: np.ndarray) -> None:
        """`advance` of a round that emitted one token per row, tokens [A], after its only
        input (two levels: nothing proposed, nothing accepted)."""
        self.tokens[live, self.count[live]] = tokens
        self.last_token[live] = tokens
        self.position[live] += 1
        self.count[live] += 1
        self.query_row[live] = np.arange(len(live))

    def positions_of(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """(position, query_row) [n] of batch rows `rows` (a list or array)."""
        index = self._index[np.asarray(rows, dtype=np.int64)]
        return self.position[index], self.query_row[index]

    def after_one_token(self, live: np.ndarray) -> "OneTokenAhead":
        """Where the rows `live` will stand once a round that emits exactly one token each
        (nothing proposed) ends, known before its tokens are read (`OneTokenAhead`)."""
        return OneTokenAhead(self, live)

    def __getitem__(self, row: int) -> RequestDrafts:
        i = self._index[row]
        out = RequestDrafts(int(self.last_token[i]), int(self.position[i]))
        out.tokens, out.query_row = self.tokens[i, :self.count[i]].tolist(), int(self.query_row[i])
        return out


class OneTokenAhead:
    """`MiddleDrafts.positions_of` as it will read after a round in which each of the rows
    `live` emits one token and proposes none (two levels, or the small draft sitting out):
    every position one further, and each row's query at its index in the round's pass
    (`advance_one`). So the round's re-selections can be launched before its one
    device-to-host copy, and on a GPU the host's selection work overlaps the device's
    pass. Example: live [0, 2] at positions [10, 40] -> positions_of([2]) = ([41], [1])."""

    def __init__(self, drafts: MiddleDrafts, live: np.ndarray):
        self.drafts = drafts
        self.query_row = np.full(len(drafts.rows), -1, dtype=np.int64)  # [n]
        self.query_row[live] = np.arange(len(live))

    def positions_of(self, rows) -> tuple[np.ndarray, np.ndarray]:
        index = self.drafts._index[np.asarray(rows, dtype=np.int64)]
        return self.drafts.position[index] + 1, self.query_row[index]


def positions_of(drafts, rows) -> tuple[np.ndarray, np.ndarray]:
    """(position, query_row) [n] of each of `rows` in `drafts`: a step's `MiddleDrafts` (or
    its `OneTokenAhead`), by its arrays, or any mapping row -> RequestDrafts."""
    if isinstance(drafts, (MiddleDrafts, OneTokenAhead)):
        return drafts.positions_of(rows)
    return (np.array([drafts[r].position for r in rows], dtype=np.int64),
            np.array([drafts[r].query_row for r in rows], dtype=np.int64))


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
        # a sampled round's distributions, verification and draws as one compiled function
        # a chunk (`compiled_sampling`: core/compiled_sampling.py; set by Drafting); None:
        # eager torch
        self.sampling = None

    def run(self, step, rows: list[int], num_drafts: list[int], probs_out: HandOffBuffer,
            use_draft: bool = True, on_round=None) -> MiddleDrafts:
        """Middle tokens for decoding `rows` of the retrieval level's `step` (its batch and
        request states): rows[i] gets at least num_drafts[i] (0: no middle
        work at all). `probs_out`: the reserved buffer `hand_off` gives vLLM, with a row for
        at least the drafting rows: the k-th middle token's distribution of the i-th
        drafting row (`MiddleDrafts.slot`) goes to probs_out.rows[i, k] as the round that
        emits it ends (k < gamma2; nothing is written when every row is greedy and
        measure_middle_acceptance is off), so no round's distributions stay alive after
        it. `use_draft` False: the small draft sits out (gamma1 = 0 this step).
        `on_round(use_draft, num_active, seconds, tokens_per_request)` hears every round's
        wall time (it ends in a device-to-host copy, so device work is included)."""
        batch = step.batch
        gamma1 = self.gamma1 if use_draft else 0
        drafts = MiddleDrafts(rows, num_drafts, np.asarray(batch.next_tokens)[rows],
                              np.asarray(batch.committed)[rows],
                              width=max(num_drafts, default=0) + gamma1 + 1)
        measured = drafts.rows[drafts.wanted > 0].tolist()
        full_probs = (self._full_cache_probs(step, drafts, measured) if self.measure
                      else None)
        # every row greedy: vLLM gets no draft probs and a round needs only argmaxes
        argmax_only = not self.measure and batch.all_greedy(rows)
        while True:
            live = drafts.live()
            if not live.size:
                return drafts
            if self.on_round_start is not None:
                self.on_round_start()
            start = time.perf_counter()
            sizes = np.minimum(gamma1, drafts.wanted[live] - drafts.count[live])
            # next round's blocks, from the newest middle tokens' queries, and its pass:
            # where a round emits one token per row, launched before its copy to the host
            ahead = self._ahead(step, drafts, live) if gamma1 == 0 else None
            emitted = self._round(step, drafts, live, sizes,
                                  None if argmax_only else probs_out, before_copy=ahead)
            more = live[drafts.count[live] < drafts.wanted[live]]
            if ahead is None and more.size:
                step.select_in_middle(drafts.rows[more], drafts)
            if on_round is not None:
                on_round(gamma1 > 0, len(live), time.perf_counter() - start,
                         emitted / len(live))
            self.stats.add(middle_rounds=1)
            if full_probs is not None:  # first round: q at the first middle position
                q = probs_out.rows[:len(measured), 0]  # the measured rows are the first slots
                self.stats.add(middle_pq_sum=float(torch.minimum(full_probs, q).sum()),
                               middle_pq_count=len(measured))
                full_probs = None

    @staticmethod
    def _ahead(step, drafts: MiddleDrafts, live: np.ndarray):
        """What follows a round that emits one token per row of `live`, as a call for
        `_round` to make with the round's tokens [len(live)] (still on the device) before
        its copy to the host: the rows that will still want tokens re-select where the
        round leaves them (`OneTokenAhead`), then the next round's pass, their new tokens
        at their next positions, is loaded (`RetrievalStep.load_ahead`; with round
        graphs). So on a GPU what the host does for the next round overlaps this round's
        device work, and after the copy only the replay is left to launch."""
        more = live[drafts.count[live] + 1 < drafts.wanted[live]]
        after = drafts.after_one_token(live)

        def ahead(tokens: torch.Tensor) -> None:
            if not more.size:
                return
            rows = drafts.rows[more]
            # their tokens: all the round's, or those at their places in it
            picked = None if more.size == live.size else np.searchsorted(live, more)
            runs = Runs(drafts.position[more] + 1, np.ones(more.size, np.int64))
            if step.reselect_and_load(rows, after, tokens, picked, runs):
                return  # as one graph (`selection_graphs`)
            step.select_in_middle(rows, after)
            step.load_ahead(rows.tolist(), tokens, picked, runs)
        return ahead

    @staticmethod
    def _full_cache_probs(step, drafts: MiddleDrafts, rows: list[int]):
        if not rows:
            return None
        return step.full_cache_probs(rows, [drafts[r].last_token for r in rows],
                                     [drafts[r].position for r in rows])

    def _round(self, step, drafts: MiddleDrafts, live: np.ndarray, sizes: np.ndarray,
               probs_out: HandOffBuffer | None, before_copy=None) -> int:
        """One round for the rows `live` of `drafts`, live[i] proposing sizes[i] tokens;
        returns the middle tokens it added over all of them. `probs_out` None: every
        request is greedy and nobody reads the middle distributions (argmax only); else
        `run`'s buffer, each row's at its slot. Everything stays on the device until the
        round's one device-to-host copy of what decides the next round: accepted counts and
        emitted tokens; `before_copy` (None: nothing) is called just before it, with each
        request's first emitted token [A] (on the device)."""
        before_copy = before_copy or (lambda tokens: None)
        batch, states = step.batch, step.states
        active, size_list = drafts.rows[live].tolist(), sizes.tolist()
        proposals, proposal_probs = None, None  # [A, max(sizes)] and [A, max(sizes), V]
        if sizes.max() > 0:
            proposals, proposal_probs = self.draft.propose(batch, states, drafts, active,
                                                           size_list,
                                                           probs=probs_out is not None)
        layout = _RoundLayout(batch.device, sizes)
        logits = step.forward(active, layout.input_ids(drafts.last_token[live], proposals),
                              Runs(drafts.position[live], sizes + 1))
        if probs_out is None and proposals is None:  # one token per request: its argmax
            tokens = logits.argmax(-1)
            before_copy(tokens)
            # the round's one copy; the next round's pass launched behind it
            drafts.advance_one(live, _on_host(tokens, step.launch_ahead))
            return len(live)
        if probs_out is None:  # no vocabulary-wide probabilities at all: nobody reads them
            argmax = layout.per_request(logits.argmax(-1, keepdim=True))[..., 0]  # [A, W]
            result = verify_greedy(proposals, argmax, layout.num_drafts)
            packed = _packed(result.num_accepted, result.output_token_ids)
        else:
            packed = self._emit(step, drafts, live, active, layout, logits, proposals,
                                proposal_probs, probs_out)
        before_copy(packed[:, 1])  # each request's first emitted token
        # [A, 1 + G + 1]: the round's one device-to-host copy, the next pass behind it
        host = _on_host(packed, step.launch_ahead)
        drafts.advance(live, host, layout.first_rows)
        if proposals is not None:  # each proposing request's round, for its own state
            self._after_proposals(states, drafts, live, size_list, host[:, 0].tolist())
        return int(host[:, 0].sum()) + len(live)

    def _emit(self, step, drafts: MiddleDrafts, live: np.ndarray, active: list[int],
              layout: "_RoundLayout", logits, proposals, proposal_probs,
              probs_out: HandOffBuffer) -> torch.Tensor:
        """What the round emits past its pass, chunk by chunk (module docstring): each chunk's
        distributions and draws (two levels: one draw from p per request; three: `verify`
        of the small draft's proposals), its rows kept in `probs_out`; returns, per request,
        [accepted drafts, emitted tokens...] on the device [A, 1 + G + 1]."""
        batch, states = step.batch, step.states
        gamma2 = probs_out.gamma2
        firsts = drafts.count[live]  # each one's next k
        rows, base, room = to_device(batch.device, active,
                                     (drafts.slot[live] * gamma2 + firsts).tolist(),
                                     (gamma2 - firsts).tolist())
        all_greedy = batch.all_greedy(active)
        compiled = self.sampling is not None and not all_greedy
        greedy = None if compiled else batch.temperature[rows] < GREEDY_TEMPERATURE  # [A]
        generators = [states[r].generator for r in active]
        size, parts = middle_chunk_requests(self.gamma1), []
        for lo in range(0, len(active), size):
            c = slice(lo, lo + size)
            tokens = layout.token_rows(c)  # the chunk's rows of the pass
            if compiled:
                accepted, emitted, target_probs = self._emit_compiled(
                    batch, layout, logits[tokens], rows[c], tokens, proposals, proposal_probs,
                    c, generators[c])
            else:
                accepted, emitted, target_probs = self._emit_eager(
                    batch, layout, logits[tokens], rows, tokens, proposals, proposal_probs,
                    c, active, greedy, generators[c], all_greedy)
            if probs_out.flat is not None:  # V1: the probabilities handed to vLLM
                _keep_probs(probs_out, target_probs, accepted + 1, base[c], room[c])
            if probs_out.logits is not None:  # MRV2: the logits the tokens were drawn from
                kept = (logits[tokens][:, None] if proposals is None
                        else layout.per_request(logits[tokens], c))
                keep_logits(probs_out.logits, kept, accepted + 1, batch.slots[rows[c]],
                            gamma2 - room[c])
            parts.append(_packed(accepted, emitted))
        return torch.cat(parts)

    def _emit_eager(self, batch, layout: "_RoundLayout", logits, rows, tokens: slice,
                    proposals, proposal_probs, c: slice, active: list[int], greedy,
                    generators, all_greedy: bool):
        """One chunk of `_emit` in eager torch: (accepted [n], emitted [n, G + 1], the
        distributions its tokens were drawn from [n, G + 1, V])."""
        of_rows = rows[c] if layout.width == 1 else rows[layout.owner[tokens]]
        probs = batch.probs(logits, active[c], of_rows)
        if proposals is None:  # the level drafts alone: one draw from p per request
            drawn = sample_tokens(probs, greedy[c], generators, self.generator,
                                  all_greedy=all_greedy)
            # what `verify` of no drafts draws, in a dozen operations instead of ~55
            return drawn.new_zeros(drawn.shape[0]), drawn[:, None], probs[:, None]
        target_probs = layout.per_request(probs, c)  # [n, max(sizes) + 1, V]
        del probs
        result = verify(proposals[c], proposal_probs[c], target_probs, layout.num_drafts[c],
                        greedy[c], generators, all_greedy=all_greedy, shared=self.generator)
        return result.num_accepted, result.output_token_ids, target_probs

    def _emit_compiled(self, batch, layout: "_RoundLayout", logits, req_rows, tokens: slice,
                       proposals, proposal_probs, c: slice, generators):
        """`_emit_eager` in one compiled call (`compiled_sampling`), after drawing its
        uniforms as the eager path does (a seeded request's from its own generator)."""
        n = req_rows.shape[0]
        if proposals is None:
            uniform = draw_uniforms(n, 1, generators, logits.device, self.generator)[:, 0]
            probs, drawn = self.sampling.draw(logits, req_rows, batch, uniform)
            return drawn.new_zeros(n), drawn[:, None], probs[:, None]
        uniform = draw_uniforms(n, proposals.shape[1] + 1, generators, logits.device,
                                self.generator)
        emitted, accepted, target_probs = self.sampling.verify(
            logits, req_rows, batch, layout.owner[tokens], layout.slot[tokens], proposals[c],
            proposal_probs[c], layout.num_drafts[c], uniform)
        return accepted, emitted, target_probs

    def _after_proposals(self, states, drafts: MiddleDrafts, live: np.ndarray,
                         sizes: list[int], accepted: list[int]) -> None:
        """The small draft's proposals of rows `live` judged: each request's draft KV
        bookkeeping, refresh acceptance and the counters."""
        proposing = [(r, proposed, kept) for r, proposed, kept
                     in zip(drafts.rows[live].tolist(), sizes, accepted) if proposed]
        for r, proposed, kept in proposing:
            self.draft.after_round(states[r], drafts[r], proposed, kept)
        self.refresh.record_rounds([states[r].refresh for r, _, _ in proposing],
                                   [p for _, p, _ in proposing], [k for _, _, k in proposing])
        self.stats.record_middle(sum(sizes), sum(a for a, n in zip(accepted, sizes) if n))


class _RoundLayout:
    """Where each request's inputs sit in a round's pass: request i (of `active`) runs
    num_inputs[i] = sizes[i] + 1 tokens (its newest, then its proposals) from row
    first_rows[i]; on the device, the request of each pass row (`owner`) and its index in
    that request's inputs (`slot`), computed there, not by a host loop per row.
    Example, sizes [2, 0, 1]: num_inputs [3, 1, 2], first_rows [0, 3, 4], owner
    [0, 0, 0, 1, 2, 2], slot [0, 1, 2, 0, 0, 1]."""

    def __init__(self, device, sizes: np.ndarray):
        self.device = device
        self.sizes = sizes                                     # [A]
        self.num_inputs = sizes + 1                            # [A]
        self.first_rows = np.cumsum(self.num_inputs) - self.num_inputs  # [A]
        self.num_rows = int(self.first_rows[-1] + self.num_inputs[-1])
        self.width = int(self.num_inputs.max())

    @functools.cached_property
    def _on_device(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(num_drafts [A], owner [T], slot [T]) on the device, made once, when first read
        (a round of one token per request needs none of them)."""
        num_drafts, num_inputs, first_rows = to_device(self.device, self.sizes,
                                                       self.num_inputs, self.first_rows)
        owner = torch.repeat_interleave(  # output_size given: no device sync
            torch.arange(len(self.sizes), device=self.device), num_inputs,
            output_size=self.num_rows)
        return num_drafts, owner, torch.arange(self.num_rows, device=self.device) - \
            first_rows[owner]

    @property
    def num_drafts(self) -> torch.Tensor:
        return self._on_device[0]

    @property
    def owner(self) -> torch.Tensor:
        return self._on_device[1]

    @property
    def slot(self) -> torch.Tensor:
        return self._on_device[2]

    def token_rows(self, requests: slice) -> slice:
        """The pass rows of requests `requests` (consecutive)."""
        start, stop, _ = requests.indices(len(self.first_rows))
        end = int(self.first_rows[stop]) if stop < len(self.first_rows) else self.num_rows
        return slice(int(self.first_rows[start]), end)

    def per_request(self, token_rows: torch.Tensor, requests: slice = slice(None)):
        """[T', ...] rows of the pass (those of `requests`) -> [n, width, ...], zero-padded."""
        rows = self.token_rows(requests)
        start = requests.indices(len(self.first_rows))[0]
        out = token_rows.new_zeros(len(self.first_rows[requests]), self.width,
                                   *token_rows.shape[1:])
        out[self.owner[rows] - start, self.slot[rows]] = token_rows
        return out

    def input_ids(self, last_tokens: np.ndarray, proposals: torch.Tensor | None):
        """The round's input ids [T]: per request its newest token, then its proposals.
        Without proposals the host's flat list (one token per request); with them one
        device tensor, assembled on the device (the host never reads the proposals)."""
        if proposals is None:
            return last_tokens.tolist()
        lasts = to_device(proposals.device, last_tokens.tolist())[0]
        proposed = proposals[self.owner, (self.slot - 1).clamp(min=0)]
        return torch.where(self.slot == 0, lasts[self.owner], proposed)


def _on_host(t: torch.Tensor, then=None) -> np.ndarray:
    """`t` as a host array, in one blocking copy (none on the CPU, where it is already).
    `then()` is called once the copy is asked for and before the host waits for it: on a
    GPU what it launches queues behind the copy, so the device runs it while the host
    takes `t` and goes on (the copy lands in pinned memory, and the host waits for an
    event recorded after it, not for the stream)."""
    if t.device.type == "cpu":
        if then is not None:
            then()
        return t.numpy()
    if then is None:
        return t.cpu().numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    then()
    copied.synchronize()
    return host.numpy()


def _packed(num_accepted: torch.Tensor, output_token_ids: torch.Tensor) -> torch.Tensor:
    """[A, 1 + G + 1]: accepted drafts, then the emitted tokens (what the host reads)."""
    return torch.cat([num_accepted[:, None], output_token_ids], 1)


def _keep_probs(probs_out: HandOffBuffer, target_probs: torch.Tensor, emitted: torch.Tensor,
                base: torch.Tensor, room: torch.Tensor) -> None:
    """Copy request i's first emitted[i] rows of target_probs [n, width, V] into the
    hand-off buffer from its flat row base[i] (its slot's row for its next middle token),
    at most room[i] of them (the rest of its gamma2), with one index copy on the device;
    every other row goes to the buffer's spare row. Example, gamma2 6, width 3, a request
    at slot 1 holding 4 middle tokens that emitted 3: base 10, room 2, rows 0 and 1 go to
    flat rows 10 and 11 (rows[1, 4] and rows[1, 5]), row 2 to the spare row."""
    kept = torch.minimum(emitted, room)  # [n] rows each request keeps
    if target_probs.shape[1] == 1:  # one row a request (the level drafting alone)
        probs_out.flat[torch.where(kept > 0, base, probs_out.spare)] = target_probs[:, 0]
        return
    j = torch.arange(target_probs.shape[1], device=base.device)
    dst = torch.where(j < kept[:, None], base[:, None] + j, probs_out.spare)  # [n, width]
    probs_out.flat[dst.flatten()] = target_probs.flatten(0, 1)


def hand_off(batch, drafts: MiddleDrafts, depths: list[int], probs_buffer: HandOffBuffer):
    """What vLLM gets: one draft list per request (`depths[i]` tokens for decoding row
    drafts.rows[i], [] for the others) and, unless every drafting row is greedy, their
    probs [D, max depth, V] with the request ids of its D rows: a view of
    `probs_buffer.rows` [drafting cap, gamma2, V], preallocated and reserved
    (engine/memory.py), which `MiddleLoop.run` filled at each drafting row's slot
    (`MiddleDrafts.slot`: the drafting rows, in order). vLLM finds a request's row by its
    id and reads its first len(drafts[r]) entries (vllm/v1/worker/gpu_model_runner.py,
    `_get_spec_decode_draft_probs`, 0.32.0; the `handoff_rows` patch hands it these ids);
    the others are not cleared. Each row must hold at least its depth in middle tokens."""
    k = np.asarray(depths, dtype=np.int64)
    drafting = drafts.rows[k > 0]
    probs, req_ids = None, None
    if drafting.size and probs_buffer.rows is not None and not batch.all_greedy(drafting):
        probs = probs_buffer.rows[:drafting.size, :int(k.max())]
        req_ids = of_rows(batch.req_ids, drafting)
    # row[:n] of each row, by `map` (no Python line per request)
    tokens = list(map(operator.getitem, drafts.tokens.tolist(), map(slice, depths)))
    if len(tokens) == batch.num_reqs:  # every request decodes: its rows are 0, 1, ...
        out = tokens
    else:
        out = [[] for _ in range(batch.num_reqs)]
        for r, row_tokens in zip(drafts.rows.tolist(), tokens):
            out[r] = row_tokens
    return out, probs, req_ids
