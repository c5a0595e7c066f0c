"""Per-request TriForce state, created with the request and freed with it.

Keyed by vLLM's request id. Selections are kept as *logical* block indices (positions //
block_size) and mapped through the request's current block table at every pass, so a
preempted-and-recomputed request (new physical blocks) stays valid; the only physical ids
kept, `lazily_set_block_ids`, are compared with the request's current blocks before use.
Draft-KV bookkeeping is reset by the rule in `invalidate_draft_from`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_triforce.core.estimates import key_set
from vllm_triforce.engine.transfer import to_device


@dataclass
class RequestState:
    # Retrieval selection (level 2): sinks + selected logical blocks per layer, row
    # `selection_row` of the device tensor [requests, num_layers, max_selected] int64 of
    # the requests that selected together (kept whole: the next pass takes it as it is when
    # its requests are those, `stacked`), and, on the host, how many and where the
    # contiguous tail begins. None until the first selection.
    selection: torch.Tensor | None = None
    selection_row: int = 0
    num_selected: int = 0
    tail_start: int = 0
    # Each layer's best candidates at the last step-start selection, re-ranked between
    # middle rounds: row `shortlist_row` of the core/selection.Shortlist of the requests
    # that selected together; and the committed length they were ranked at.
    shortlists: object = None
    shortlist_row: int = 0
    shortlist_committed: int = -1
    # Lazy block summaries (engine/summary_keeper.py `set_full_blocks`): the physical ids
    # of the request's full blocks whose summaries it last saw set, in logical order, and
    # the content key of each full block (a hash chained over its tokens and every earlier
    # block's).
    lazily_set_block_ids: list[int] = field(default_factory=list)
    block_contents: list[int] = field(default_factory=list)
    # positions [eager_start, eager_end) whose keys the request's last prefill passes, one
    # after the other, folded into the summaries (-1: none yet)
    eager_start: int = 0
    eager_end: int = -1
    refresh: int = -1                            # its row of core.refresh.RefreshPolicy
    policy_state: object = None                  # core.scoring.SelectionState (h2o)
    # Small-draft (level 1) KV bookkeeping, in absolute positions.
    draft_valid_upto: int = 0      # draft KV is valid for positions [window_start, this)
    draft_sinks_valid: bool = False
    draft_rebase_offset: int = 0   # see core/streaming.py
    # Middle-level drafts handed to vLLM last step (to count top-level acceptance).
    last_num_drafts: int = 0
    generator: torch.Generator | None = None

    def invalidate_draft_from(self, position: int, sink_tokens: int) -> None:
        """The target recomputed tokens from `position` on (a verification pass, a prefill
        chunk, a recompute after preemption): any draft KV there is stale. Re-running the
        draft over those few tokens is what vLLM's own draft_model path does each step."""
        self.draft_valid_upto = min(self.draft_valid_upto, position)
        if position < sink_tokens:
            self.draft_sinks_valid = False


def stacked(batches: list, rows: list[int], fields=lambda batch: (batch,)) -> list:
    """Row rows[i] of batches[i], stacked, for each of the tensors `fields(batch)` returns
    (default: the batch, a tensor, itself). The batch's own tensors when every row is one
    batch's, all of it in order (a middle round whose requests selected together: no
    operation at all), one index when they share a batch, else one stack per field."""
    first = batches[0]
    if all(b is first for b in batches):
        tensors = fields(first)
        if rows == list(range(tensors[0].shape[0])):
            return list(tensors)
        index = to_device(tensors[0].device, rows)[0]
        return [t[index] for t in tensors]
    per_batch = [fields(b) for b in batches]
    return [torch.stack([f[k][i] for f, i in zip(per_batch, rows)])
            for k in range(len(per_batch[0]))]


def stacked_shortlist(shortlists: list, rows: list[int]):
    """`stacked` for core/selection.Shortlists: row rows[i] of shortlists[i], as one; the
    shortlist itself when all are rows of one, all of it in order."""
    from vllm_triforce.core.selection import Frame, Shortlist

    first = shortlists[0]
    if all(s is first for s in shortlists) and rows == list(range(first.logical.shape[0])):
        return first
    logical, physical, *frame = stacked(
        shortlists, rows, lambda s: (s.logical, s.physical, s.frame.num_chosen,
                                     s.frame.sink_ids, s.frame.num_selected,
                                     s.frame.tail_start))
    return Shortlist(logical, physical, Frame(*frame))


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
        return [self.states.pop(req_id) for req_id in gone]

    def __len__(self) -> int:
        return len(self.states)
