"""Steps TriForce has nothing to do in, told apart on the host before any device value is read.

Most steps of a real workload draft nothing (a request whose context fits the retrieval
budget never drafts: the middle level would be the target itself). Such a step needs
nothing from the device, and on a GPU the proposer's first read of a device value
(`StepBatch.from_runner`'s copy) would make the host wait for vLLM's pass. So `PlainSteps`
decides first, from what the host already holds, whether the step's output needs any
TriForce work, and if not returns vLLM its empty drafts at once: no batch, no sync, no
per-layer work. A step qualifies when

- no request was handed a draft last step (there is nothing of vLLM's verification to
  count: its rejected counts stay on the device);
- the depth is not fixed above 0 (`set_fixed_depth`, `adaptive: false`);
- every decoding request decodes plainly by rule (engine/depth.py): its context fits the
  retrieval budget (core/controller.middle_level_is_the_target), or its sampling needs
  vLLM's plain sampler, or the depth is fixed at 0;
- none of the pass's keys must go into the block summaries: each prefill chunk belongs to
  a request that never drafts (`never_drafts`), and unless the summaries of decoded blocks
  are set lazily from the KV cache (engine/summary_keeper.py, decided by the reader's check
  at the first commit that needs it), no request of the step may ever draft.

The question is asked during vLLM's pass, at its first layer (engine/device/capture.py
`reads_pass`), and a plain step's pass is not recorded at all: no layer's query or key is
copied. `propose` then takes that answer for the step.

A step that fails only the third condition (a request past the budget, under the depth
controller) may still be plain: where nothing was handed last step, on one TP rank, with
summaries set lazily, no prefill chunk of a request that may draft and no seeded request,
the controller plans the step then and there (`PlainSteps.plan_ahead`, engine/depth.py
`DepthChooser.plan_ahead`), from the same host facts; a plan of depth 0 for every request
makes the step a plain one like the above, and a plan that drafts is the one the step
takes after the pass. Most decode steps of a long-context workload are of this kind (the
controller chose depth 0 in 753 of 757 steps of the real-model run on an H200). The V1
runner asks it during vLLM's pass (engine/proposer.py `_reads_pass`), Model Runner V2's
speculator before it builds a step's batch, and with FULL decode graphs before vLLM's
pass (engine/mrv2/speculator.py `_is_plain`); `plan_ahead` False turns it off in either.

What a plain step still does is what the depth controller's clocks need (`DepthChooser.begin`
and `DepthStep.end`: vLLM's step time) and the counters (a plain step, `host_plain_steps`).
Per-request state is taken up at the next step that does work (`StateTable.of_batch`); on
Model Runner V2 so are the step's tokens (the speculator's records, engine/mrv2/requests.py,
read them from vLLM's token history then).

Host facts read (`PassFacts`, exact under synchronous scheduling, which TriForce runs),
vLLM 0.32.0 and 0.33.0:
- V1 runner (vllm/v1/worker/gpu_model_runner.py, `read_v1`): the verification pass's
  `CommonAttentionMetadata` host copies `query_start_loc_cpu` and
  `seq_lens_cpu_upper_bound`, `input_batch.req_ids` and `discard_request_mask`; during
  the pass (`read_v1_ahead`) the runner's buffers those copies are views of,
  `query_start_loc` and `optimistic_seq_lens_cpu`;
- Model Runner V2 (vllm/v1/worker/gpu/input_batch.py, `read_mrv2`): the pass's
  `InputBatch` host arrays `req_ids`, `query_start_loc_np`, `seq_lens_cpu_upper_bound`
  and `prefill_len_np`;
- and each request's `num_prompt_tokens` and `sampling_params` (V1's `CachedRequestState`,
  MRV2's `RequestRecord`, engine/mrv2/requests.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from vllm_triforce.core.controller import middle_level_is_the_target
from vllm_triforce.engine.batch import of_rows
from vllm_triforce.engine.depth import Verified, decodes_plainly


def never_drafts(request, block_size: int, budget_blocks: int) -> bool:
    """Whether a request never drafts under the depth controller, so TriForce keeps nothing
    for it: its sampling needs vLLM's plain sampler, or its longest context (prompt plus
    max_tokens) fits the retrieval budget. Example, blocks of 32, a 4,096-token budget:
    a 1,500-token prompt with max_tokens 48 never drafts; with max_tokens 4,000 it may."""
    params = getattr(request, "sampling_params", None)
    if decodes_plainly(params):
        return True
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is None:
        return False
    return middle_level_is_the_target(request.num_prompt_tokens + max_tokens, block_size,
                                      budget_blocks)


@dataclass
class PassFacts:
    """What the host knows of vLLM's verification pass before any device value is read."""
    req_ids: list[str]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray         # [R], after the pass
    decoding: np.ndarray         # [R] bool: the pass samples a token (not a partial prefill)

    @functools.cached_property
    def prefill(self) -> np.ndarray:
        """[R] bool: the row is a prefill chunk (more than one token, none of them handed
        drafts: `is_plain` asks only where nothing was handed last step)."""
        qsl = self.query_start_loc
        return (qsl[1:] - qsl[:-1]) > 1  # np.diff's own overhead is most of a small batch's


class PlainSteps:
    """Finds the steps with nothing to do (module docstring) for an engine of `blocks`
    (config.BlockCounts), whose summaries `keeper` keeps and whose depths `depth` chooses
    (engine/depth.DepthChooser); counts them in `stats`."""

    def __init__(self, blocks, keeper, depth, stats):
        self.blocks = blocks
        self.keeper = keeper
        self.depth = depth
        self.stats = stats
        # the last batch's request ids, and each one's `never_drafts` and `decodes_plainly`
        self._known: tuple[list[str], np.ndarray, np.ndarray] | None = None

    def never(self, req_ids: list[str], requests) -> np.ndarray:
        """[R] `never_drafts` of each request (`requests`: req_id -> CachedRequestState);
        all False while the depth is fixed (every request drafts then)."""
        if self.depth.fixed_depth is not None:
            return np.zeros(len(req_ids), dtype=bool)
        return self._request_facts(req_ids, requests)[0]

    def _request_facts(self, req_ids: list[str], requests) -> tuple[np.ndarray, np.ndarray]:
        """([R] `never_drafts`, [R] `decodes_plainly`) of each request. Neither changes
        during a request: taken again while the batch's requests are the last one's."""
        if self._known is None or self._known[0] != req_ids:
            bs, budget = self.blocks.block_size, self.blocks.budget_blocks
            records = [requests[r] for r in req_ids]
            never = np.fromiter((never_drafts(r, bs, budget) for r in records), dtype=bool,
                                count=len(records))
            plain = np.fromiter((decodes_plainly(getattr(r, "sampling_params", None))
                                 for r in records), dtype=bool, count=len(records))
            self._known = (list(req_ids), never, plain)
        return self._known[1], self._known[2]

    def is_plain(self, facts: PassFacts | None, requests, handed_last: bool) -> bool:
        """Whether every request of the pass decodes plainly, with nothing for TriForce to
        read of it (module docstring): the same answer before vLLM's pass as after it (the
        same host facts), so a runner may ask it to choose the pass's CUDA graph
        (engine/mrv2/speculator.py)."""
        fixed = self.depth.fixed_depth
        if handed_last or (fixed is not None and fixed > 0) or facts is None:
            return False
        never = self.never(facts.req_ids, requests)
        if never.all():  # nobody drafts, now or later: nothing else to look at
            return True
        if not self.keeper.lazy:  # summaries folded at every commit
            return False
        if (facts.prefill & ~never).any():  # its keys go into the summaries now
            return False
        if fixed != 0:
            fits = -(-facts.seq_lens // self.blocks.block_size) <= self.blocks.budget_blocks
            if (facts.decoding & ~fits & ~never).any():  # the controller may draft for it
                return False
        return True

    def plan_ahead(self, facts: PassFacts | None, requests, handed_last: bool,
                   max_depth: int, seeded: bool) -> bool:
        """Whether a step `is_plain` found work in is plain after all: the depth controller,
        asked now, during vLLM's pass (engine/depth.py `DepthChooser.plan_ahead`), gives
        every decoding request depth 0. Asked only where nothing but the controller's
        choice stands between the step and a plain one: nothing handed last step, the
        controller deciding (no fixed depth) on one TP rank, summaries set lazily, no
        prefill chunk of a request that may draft, and no seeded request in the batch
        (`seeded`: a seeded request's depth is read from its own length, not a clock). The
        plan is kept: the step takes it either way. `max_depth`: the configured depth
        (vLLM's bound for the step, known only after its pass, cuts a drafting plan)."""
        depth = self.depth
        if (handed_last or facts is None or seeded or depth.fixed_depth is not None
                or depth.share is not None or not self.keeper.lazy):
            return False
        never, plain = self._request_facts(facts.req_ids, requests)
        if (facts.prefill & ~never).any():
            return False
        rows = np.flatnonzero(facts.decoding)
        return not depth.plan_ahead(of_rows(facts.req_ids, rows), max_depth,
                                    facts.seq_lens[rows].tolist(), plain[rows].tolist())

    def record(self, facts: PassFacts, requests, start: float) -> None:
        """A plain step's timing for the depth chooser, and its counters."""
        decoding = facts.decoding
        num_tokens = int(facts.query_start_loc[-1])
        step = self.depth.begin(start, facts.req_ids, num_tokens=num_tokens,
                                emitted=num_tokens,
                                pure_decode=bool(decoding.all()) and not facts.prefill.any(),
                                verified=Verified.none(), live_req_ids=requests)
        if self.depth.planned_ahead:  # the controller chose it (`plan_ahead`)
            step.take_plan_ahead(of_rows(facts.req_ids, np.flatnonzero(decoding)))
        self.stats.record_plain(int(decoding.sum()))
        step.end(drafting=False)
        self.stats.add(host_plain_steps=1)

    @staticmethod
    def read_v1(runner, cad) -> PassFacts | None:
        """The V1 runner's host copies of its pass (vLLM's runner made them before the
        pass; no device value is read); None without the sequence lengths' host copy."""
        if cad.seq_lens_cpu_upper_bound is None:
            return None
        num_reqs = cad.num_reqs
        return PassFacts(req_ids=list(runner.input_batch.req_ids[:num_reqs]),
                         query_start_loc=cad.query_start_loc_cpu[:num_reqs + 1].numpy(),
                         seq_lens=cad.seq_lens_cpu_upper_bound[:num_reqs].numpy(),
                         decoding=~runner.discard_request_mask.np[:num_reqs])

    @staticmethod
    def read_v1_ahead(runner) -> PassFacts:
        """`read_v1`'s facts during vLLM's pass (before `propose`), from the V1 runner's
        host buffers that its `_prepare_inputs` filled for the pass, the ones the pass's
        `CommonAttentionMetadata` holds views of: the same values."""
        num_reqs = runner.input_batch.num_reqs
        return PassFacts(req_ids=list(runner.input_batch.req_ids[:num_reqs]),
                         query_start_loc=runner.query_start_loc.np[:num_reqs + 1],
                         seq_lens=runner.optimistic_seq_lens_cpu[:num_reqs].numpy(),
                         decoding=~runner.discard_request_mask.np[:num_reqs])

    @staticmethod
    def read_mrv2_ahead(batch_req_state, num_computed_tokens_np) -> PassFacts:
        """`read_mrv2`'s facts before vLLM's pass, from Model Runner V2's `BatchReqState`
        (`GPUModelRunner.gather_batch_req_state`) and its host `num_computed_tokens_np` by
        slot: the pass's `InputBatch` is built from the same numbers (its sequence lengths
        are computed + scheduled, its query starts their running sum)."""
        scheduled = np.asarray(batch_req_state.num_scheduled_tokens)
        seq_lens = num_computed_tokens_np[batch_req_state.idx_mapping_np] + scheduled
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(scheduled, out=qsl[1:])
        return PassFacts(req_ids=list(batch_req_state.req_ids), query_start_loc=qsl,
                         seq_lens=seq_lens,
                         decoding=seq_lens >= batch_req_state.prefill_len_np)

    @staticmethod
    def read_mrv2(input_batch) -> PassFacts:
        """Model Runner V2's host arrays of its pass: a row samples a token once its
        prefill (the prompt, and after a resumption its earlier outputs) is all in.
        Example: a 10-token prompt whose pass covers 0..4 does not decode; one whose
        pass ends at 10 does."""
        num_reqs = input_batch.num_reqs
        seq_lens = input_batch.seq_lens_cpu_upper_bound[:num_reqs].numpy()
        return PassFacts(req_ids=list(input_batch.req_ids[:num_reqs]),
                         query_start_loc=input_batch.query_start_loc_np[:num_reqs + 1],
                         seq_lens=seq_lens,
                         decoding=seq_lens >= input_batch.prefill_len_np[:num_reqs])
