"""Per-request TriForce state, created with the request and freed with it.

Keyed by vLLM's request id. Selections (the retrieval level's engine/selections.py, at
each request's row) are kept as *logical* block indices (positions // block_size) and
mapped through the request's current block table at every pass, so a
preempted-and-recomputed request (new physical blocks) stays valid; the only physical ids
kept, `lazily_set_block_ids`, are compared with the request's current blocks before use.
Draft-KV bookkeeping is reset by the rule in `invalidate_draft_from`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_triforce.core.estimates import key_set


@dataclass
class RequestState:
    # Lazy block summaries (engine/summary_keeper.py `set_full_blocks`): the physical ids
    # of the request's full blocks whose summaries it last saw set, in logical order, and
    # the content key of each full block (a hash chained over its tokens and every earlier
    # block's).
    lazily_set_block_ids: list[int] = field(default_factory=list)
    # the list of block ids (vLLM's, one KV group) those were read from: while it is the
    # request's list and as long, nothing changed (`set_full_blocks`)
    lazily_set_from: list[int] | None = None
    block_contents: list[int] = field(default_factory=list)
    # positions [eager_start, eager_end) whose keys the request's last prefill passes, one
    # after the other, folded into the summaries (-1: none yet)
    eager_start: int = 0
    eager_end: int = -1
    # its row of core.refresh.RefreshPolicy's arrays, and of the retrieval level's
    # engine/selections.SelectionTable (its selection, the shortlist row it holds)
    refresh: int = -1
    policy_state: object = None                  # core.scoring.SelectionState (h2o)
    # Small-draft (level 1) KV bookkeeping, in absolute positions.
    draft_valid_upto: int = 0      # draft KV is valid for positions [window_start, this)
    draft_sinks_valid: bool = False
    draft_rebase_offset: int = 0   # see core/streaming.py
    generator: torch.Generator | None = None

    def invalidate_draft_from(self, position: int, sink_tokens: int) -> None:
        """The target recomputed tokens from `position` on (a verification pass, a prefill
        chunk, a recompute after preemption): any draft KV there is stale. Re-running the
        draft over those few tokens is what vLLM's own draft_model path does each step."""
        self.draft_valid_upto = min(self.draft_valid_upto, position)
        if position < sink_tokens:
            self.draft_sinks_valid = False


class StateTable:
    """req_id -> RequestState; states of requests vLLM no longer holds are dropped."""

    def __init__(self):
        self.states: dict[str, RequestState] = {}
        # the last `of_batch`: its request ids, the live requests' count, and its states
        self._last: tuple[list[str], int, list[RequestState]] | None = None

    def of_batch(self, req_ids: list[str], live_req_ids, make
                 ) -> tuple[list[RequestState], list[RequestState]]:
        """(the states of `req_ids`, in order, made where new; the states dropped because
        their requests are not in `live_req_ids`). A step whose requests are the last
        step's, with as many live requests, takes the last step's list again: none of its
        requests is new or gone (each was live at both steps). A request outside the batch
        that left while another arrived is dropped at the next step whose batch differs."""
        last = self._last
        if last is not None and last[1] == len(live_req_ids) and last[0] == req_ids:
            return last[2], []
        dropped = self.retain(live_req_ids)
        states = [self.get(r, make) for r in req_ids]
        self._last = (list(req_ids), len(live_req_ids), states)
        return states, dropped

    def get(self, req_id: str, make) -> RequestState:
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = make(req_id)
        return state

    def retain(self, live_req_ids) -> list[RequestState]:
        """Drops the states of requests not in `live_req_ids`; returns them."""
        gone = self.states.keys() - key_set(live_req_ids)
        if gone:  # the last batch's list may hold them: never taken again
            self._last = None
        return [self.states.pop(req_id) for req_id in gone]

    def __len__(self) -> int:
        return len(self.states)
