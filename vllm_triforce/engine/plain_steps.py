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

What the step still does is what the depth controller's clocks need (`DepthChooser.begin`
and `DepthStep.end`: vLLM's step time) and the counters (a plain step, `host_plain_steps`).
Per-request state is taken up at the next step that does work (`StateTable.of_batch`).

Host facts read (vLLM 0.32.0 V1 runner, vllm/v1/worker/gpu_model_runner.py): the
verification pass's `CommonAttentionMetadata` host copies `query_start_loc_cpu` and
`seq_lens_cpu_upper_bound` (exact under synchronous scheduling, which TriForce runs),
`input_batch.req_ids`, `discard_request_mask` and each `CachedRequestState`'s
`num_prompt_tokens` and `sampling_params`.
"""

from __future__ import annotations

import numpy as np

from vllm_triforce.core.controller import middle_level_is_the_target
from vllm_triforce.engine.depth import decodes_plainly


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


class PlainSteps:
    """Finds the steps with nothing to do (module docstring) for an engine of `blocks`
    (config.BlockCounts), whose summaries `keeper` keeps and whose depths `depth` chooses
    (engine/depth.DepthChooser); counts them in `stats`."""

    def __init__(self, blocks, keeper, depth, stats):
        self.blocks = blocks
        self.keeper = keeper
        self.depth = depth
        self.stats = stats
        self._never: tuple[list[str], np.ndarray] | None = None  # the last batch's

    def never(self, req_ids: list[str], requests) -> np.ndarray:
        """[R] `never_drafts` of each request (`requests`: req_id -> CachedRequestState);
        all False while the depth is fixed (every request drafts then). Taken again while
        the batch's requests are the last one's."""
        if self.depth.fixed_depth is not None:
            return np.zeros(len(req_ids), dtype=bool)
        if self._never is None or self._never[0] != req_ids:
            bs, budget = self.blocks.block_size, self.blocks.budget_blocks
            never = np.fromiter((never_drafts(requests[r], bs, budget) for r in req_ids),
                                dtype=bool, count=len(req_ids))
            self._never = (list(req_ids), never)
        return self._never[1]

    def try_step(self, runner, cad, start: float, handed_last: bool) -> list[list[int]] | None:
        """The step's drafts ([] for every request) when it needs no TriForce work, after
        telling the depth chooser its timing; None: the step needs the full path."""
        fixed = self.depth.fixed_depth
        upper = cad.seq_lens_cpu_upper_bound
        if handed_last or (fixed is not None and fixed > 0) or upper is None:
            return None
        num_reqs = cad.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        never = self.never(req_ids, runner.requests)
        if not self.keeper.lazy and not never.all():  # summaries folded at every commit
            return None
        qsl, seq_lens = self.host_lengths(cad)
        q_lens = np.diff(qsl)
        decoding = ~runner.discard_request_mask.np[:num_reqs]
        prefill = q_lens > 1  # nothing was handed: more than one token is a prefill chunk
        if (prefill & ~never).any():  # its keys go into the summaries now
            return None
        if fixed != 0:
            fits = -(-seq_lens // self.blocks.block_size) <= self.blocks.budget_blocks
            if (decoding & ~fits & ~never).any():  # the controller may draft for it
                return None
        num_tokens = int(qsl[-1])
        step = self.depth.begin(start, req_ids, num_tokens=num_tokens, emitted=num_tokens,
                                pure_decode=bool(decoding.all()) and not prefill.any(),
                                verified=[], live_req_ids=runner.requests)
        self.stats.record_depths([0] * int(decoding.sum()))
        step.end(drafting=False)
        self.stats.add(host_plain_steps=1)
        return [[] for _ in range(num_reqs)]

    @staticmethod
    def host_lengths(cad) -> tuple[np.ndarray, np.ndarray]:
        """(query starts [R + 1], sequence lengths [R]) of vLLM's pass, from the host copies
        vLLM's runner made of them before the pass (no device value is read)."""
        num_reqs = cad.num_reqs
        return (cad.query_start_loc_cpu[:num_reqs + 1].numpy(),
                cad.seq_lens_cpu_upper_bound[:num_reqs].numpy())
