"""vLLM finds each request's draft probabilities in TriForce's compact hand-off buffer.

Upstream (vLLM 0.32.0, `v1/worker/gpu_model_runner.py`): after the drafter proposes,
`GPUModelRunner.propose_draft_token_ids` keeps `drafter.take_last_draft_probs()` as
`_draft_probs` and records `_draft_prob_req_ids = input_batch.req_ids.copy()`, the batch's
request ids in row order; at the next step `_get_spec_decode_draft_probs` finds each
request's row by its id in that list and reads `_draft_probs[row, :num_draft]`. So a
drafter must hand vLLM one row per request of the batch: `[max_num_seqs, gamma2, V]`
float32 kept for the largest batch (3.2 GB at vLLM's H100 default of 1,024 sequences and a
128K vocabulary), in batch order, although TriForce has rows only for the requests that may
draft at once (the drafting cap, engine/memory.py `Sizing.drafting`: max_num_seqs, or fewer
where the KV cache's share holds fewer) and fills them in the order they draft.

How: wrap `propose_draft_token_ids`; after it returns, if vLLM kept draft probabilities and
the drafter names the request of each of their rows (`last_draft_prob_req_ids()`, TriForce's
proposer: its drafting requests, in the buffer's row order), `_draft_prob_req_ids` becomes
that list. vLLM's own lookup by request id then reads row i of the compact buffer
`[D, gamma2, V]` for the i-th drafting request; requests without drafts are never looked up
(`num_draft == 0`). No vLLM code is copied: the list vLLM builds is replaced by one of the
same kind.

Gate: a drafter with `last_draft_prob_req_ids` returning a list, and `_draft_probs` set.
Upstream: none known. Remove when vLLM lets a drafter hand probabilities for its drafting
requests only.
"""

from vllm_triforce.patches import _util

NAME = "handoff_rows"
TARGET = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids")


def apply() -> None:
    _util.wrap(*TARGET, _make_propose_draft_token_ids, NAME)


def _make_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        draft_token_ids = original(self, *args, **kwargs)
        req_ids_of = getattr(getattr(self, "drafter", None), "last_draft_prob_req_ids", None)
        req_ids = req_ids_of() if req_ids_of is not None else None
        if req_ids is not None and getattr(self, "_draft_probs", None) is not None:
            self._draft_prob_req_ids = list(req_ids)
        return draft_token_ids

    return propose_draft_token_ids
