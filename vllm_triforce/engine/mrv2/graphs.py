"""FULL decode graphs for TriForce on Model Runner V2: vLLM replays a whole decode step as
one CUDA graph wherever TriForce reads nothing of the step's pass, and keeps the piecewise
graphs (attention run eagerly, so the query/key capture sees it) where it does.

Taken only when asked for: `VLLM_TRIFORCE_MRV2=1` (or `VLLM_USE_V2_MODEL_RUNNER=1`) with
an explicit `cudagraph_mode=FULL_AND_PIECEWISE` (engine_settings.py; experimental, as the
binding).

Why this is enough (vllm/v1/worker/gpu/, 0.32.0 and 0.33.0). A FULL graph replays
attention without Python, so TriForce's capture (engine/device/capture.py) sees no query or
key of that pass. Two kinds of steps read them: a step in which some request drafts or may
(its selection reads the newest committed token's query), and a step whose keys go into the
block summaries. Every other step is a plain step (engine/plain_steps.py `is_plain`, or
`plan_ahead`: the depth controller, asked before the pass, gives every request depth 0),
and those are most steps of a real workload. The runner decides, from the same host facts,
before vLLM's pass (`PlainSteps.read_mrv2_ahead`, from `gather_batch_req_state`) whether
the pass is read; a pass that is read is dispatched as a batch no FULL graph takes
(`CaptureDemotion`: no uniform token count, no query-length bound), which runs the
piecewise graphs. The speculator then takes that same decision for the step
(`TriForceSpeculator.plan_pass`), so it never works on a pass it did not capture.

- Which FULL graphs: by default vLLM captures FULL decode graphs only for batches of
  exactly 1 + K tokens per request (`CudaGraphManager._init_candidates`); a plain step
  has 1 token per request. MRV2's variable-length decode graphs (any mix of 1 .. 1 + K
  tokens per request, captured for adaptive verification) take them: `use_varlen_decode`
  sets `varlen_decode` and rebuilds the candidates, before `capture_model`, where every
  target attention backend replays such batches (vLLM's
  `get_varlen_cudagraph_unsupported_backend`: FLASH_ATTN does); elsewhere only uniform
  1 + K batches TriForce reads nothing of replay FULL.
- vLLM's own capture of its FULL graphs runs the attention wrappers; the capture skips
  recording then (`LayerCapture.skip_while_capturing`), so no TriForce copy is baked into a
  graph that every step replays.
"""

from __future__ import annotations


def takes_full_decode(manager) -> bool:
    """Whether vLLM's graph manager replays decode batches as FULL graphs and the others
    piecewise (cudagraph_mode FULL_AND_PIECEWISE)."""
    mode = getattr(manager, "cudagraph_mode", None)
    if not mode or not mode.separate_routine():
        return False
    return mode.decode_mode().name == "FULL" and mode.mixed_mode().name == "PIECEWISE"


def use_varlen_decode(manager) -> None:
    """Capture variable-length FULL decode graphs (1 .. 1 + K tokens per request), so that
    plain and mixed-depth decode steps replay FULL too; before vLLM captures its graphs."""
    if manager.varlen_decode:
        return
    manager.varlen_decode = True
    manager._candidates.clear()
    manager._capture_descs.clear()
    manager._init_candidates()


class CaptureDemotion:
    """Wraps a graph manager's `dispatch`: while `needs_capture`, the batch is dispatched
    with no uniform token count and no query-length bound, so no FULL decode graph takes it
    and it runs piecewise (the capture sees its attention). Set before each pass."""

    def __init__(self, manager):
        self.needs_capture = False
        self._dispatch = manager.dispatch
        manager.dispatch = self.dispatch

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):
        if self.needs_capture:
            uniform_token_count, max_query_len = None, None
        return self._dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                              max_query_len=max_query_len, num_ubatches=num_ubatches)
