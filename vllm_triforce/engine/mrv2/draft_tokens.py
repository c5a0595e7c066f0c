"""Per-request draft counts handed back to vLLM's scheduler from Model Runner V2.

Under synchronous scheduling, after each step `EngineCore` hands the runner's
`take_draft_token_ids()` to `Scheduler.update_draft_token_ids` (vllm/v1/engine/core.py,
0.32.0 and 0.33.0), and the scheduler schedules each request's own list: its length is
the number of draft slots the request verifies next step, the ids themselves are not read
(the runner takes the drafts from `req_states.draft_tokens` on the device). MRV2's
`DraftTokensHandler.get_draft_tokens` (vllm/v1/worker/gpu/spec_decode/utils.py) hands
`[-1] * K` to every request, K = num_speculative_tokens (with structured outputs, the K
real ids, for the grammar); TriForce drafts k_r <= K tokens for request r (0: a plain
decode, no verification slots, vLLM's plain sampler). `DraftCounts` wraps the stock
handler and keeps the first k_r of each list: `[-1] * k_r`, or the k_r real ids.

Example, K = 3: depths {a: 3, b: 0, c: 1} turn the stock [[-1]*3] * 3 into
[[-1, -1, -1], [], [-1]]; next step the scheduler gives a 4 tokens, b 1 and c 2.
A request the speculator set no depth for this step (a dummy run's) gets none.

Under async scheduling (explicit `--async-scheduling` with `VLLM_TRIFORCE_MRV2=1`) the
scheduler never hears these counts: it schedules step N + 1 before step N has drafted,
K placeholder drafts for every decoding request (`AsyncScheduler._update_after_schedule`,
vllm/v1/core/sched/async_scheduler.py). The runner then cuts each request's scheduled
drafts to its k_r before the step runs (`trimmed`), on a copy of the `SchedulerOutput`:
with the in-process executor the scheduler hands the worker its own object, and after the
step it reads the drafts it scheduled to roll `num_computed_tokens` back (a cut slot
counts as a rejected draft: `Scheduler.update_from_output`). For vLLM's spec-decode
metrics the cut slots are what a grammar's invalid drafts are (`note_cut`): scheduled, and
rolled back, but not drafted; the scheduler takes them off the drafted counts
(`SchedulerOutput.num_invalid_spec_tokens`, read by `make_spec_decoding_stats` and the
per-request metrics alone). That reaches the scheduler where it shares its object with the
worker (the in-process executor of a one-GPU engine); a multiprocess executor's workers
get a copy, and there vLLM's metrics still count a cut slot as a rejected draft. In both,
a request cut to depth 0 still counts as one draft of no tokens in vLLM's `num_drafts`
(its mean acceptance length); TriForce's own counters (`vllm:triforce_*`) count neither.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.outputs import DraftTokenIds


class DraftCounts:
    """The runner's `draft_tokens_handler` (`set_draft_tokens`, `get_draft_tokens`), with
    per-request counts set by the speculator (`set_depths`) each step, before the runner
    calls `set_draft_tokens` (vllm/v1/worker/gpu/model_runner.py `sample_tokens`)."""

    def __init__(self, stock):
        self.stock = stock  # vLLM's DraftTokensHandler: the copy for structured outputs
        self.depths: dict[str, int] = {}

    def set_depths(self, req_ids: list[str], depths: list[int]) -> None:
        """This step's draft count per request (k_r, 0 <= k_r <= K)."""
        self.depths = dict(zip(req_ids, depths))

    def set_draft_tokens(self, input_batch, draft_tokens) -> None:
        self.stock.set_draft_tokens(input_batch, draft_tokens)

    def get_draft_tokens(self) -> DraftTokenIds | None:
        stock = self.stock.get_draft_tokens()
        if stock is None:
            return None
        counts = [self.depths.get(req_id, 0) for req_id in stock.req_ids]
        return DraftTokenIds(stock.req_ids, [list(ids[:k]) for ids, k
                                             in zip(stock.draft_token_ids, counts)])

    def trimmed(self, scheduler_output):
        """`scheduler_output` with each request's scheduled drafts cut to its depth of the
        last step (requests with no depth set keep theirs: vLLM's own warm-up batches), as
        a copy; the object itself when nothing is cut (synchronous scheduling: the
        scheduler already scheduled k_r), or when structured outputs are scheduled (their
        grammar bitmask counts the scheduled drafts; a -1 draft is rejected, so leaving it
        costs verification tokens, not exactness).

        Example, K = 3, depths {a: 1, b: 0}: scheduled {a: 4, b: 4, c: 1} tokens with drafts
        {a: [-1]*3, b: [-1]*3} become {a: 2, b: 1, c: 1} with drafts {a: [-1]}."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec or scheduler_output.has_structured_output_requests:
            return scheduler_output
        keep = {r: min(len(ids), self.depths[r]) for r, ids in spec.items() if r in self.depths}
        if all(k == len(spec[r]) for r, k in keep.items()):
            return scheduler_output
        num_scheduled = dict(scheduler_output.num_scheduled_tokens)
        drafts = {}
        for r, ids in spec.items():
            k = keep.get(r, len(ids))
            num_scheduled[r] -= len(ids) - k
            if k:
                drafts[r] = ids[:k]
        return dataclasses.replace(
            scheduler_output, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=drafts)


def note_cut(scheduled, cut) -> None:
    """On the scheduler's own output `scheduled`, the slots `cut` (its `DraftCounts.trimmed`
    copy) took off each request, as vLLM's `num_invalid_spec_tokens` (module docstring):
    vLLM's spec-decode metrics then count only the drafts the step verified. Example:
    scheduled {a: [-1]*3, b: [-1]*3}, cut to {a: [-1]} -> {a: 2, b: 3}."""
    kept = cut.scheduled_spec_decode_tokens
    cuts = {r: len(ids) - len(kept.get(r, ()))
            for r, ids in scheduled.scheduled_spec_decode_tokens.items()}
    cuts = {r: n for r, n in cuts.items() if n}
    if cuts:
        scheduled.num_invalid_spec_tokens = {**(scheduled.num_invalid_spec_tokens or {}), **cuts}
