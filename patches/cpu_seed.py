"""Per-request seeds on CPU: rewind a discarded sample by restoring the generator state.

Upstream (vLLM 0.32.0, `v1/worker/gpu_model_runner.py`, `GPUModelRunner._bookkeeping_sync`):
when a request's sampled token is discarded (a chunked-prefill step that is not
the last chunk), the runner undoes the sample's use of the request's seeded
generator with `gen.set_offset(gen.get_offset() - 4)`. That is a CUDA Philox
detail; a CPU generator (Mersenne Twister) has no offset and raises
`RuntimeError: CPU Generator does not use offset`, killing the engine as soon
as a seeded request's prefill is chunked. `CPUModelRunner` inherits this code.

Fix, for CPU generators only: remember the generator states of the requests
whose sample will be discarded just before the step samples (wrapped `_sample`)
and restore them at the rewind point (wrapped `_bookkeeping_sync`), hiding
those generators from the original offset rewind. Restoring the state undoes
every draw the step made for the request, so the request's first kept token
sees the same generator state as in a run whose prefill was not chunked.
CUDA generators are left to the original code.

Why a patch: the rewind is inline in a private runner method; there is no hook
around sampling or bookkeeping, and generators are created in `_update_states`
with `torch.Generator(device=self.device)` (no factory to swap).
"""

import numpy as np

from vllm_triforce.patches import _util

NAME = "cpu_seed"
MODULE = "vllm.v1.worker.gpu_model_runner"
SNAPSHOT_ATTR = "_triforce_discarded_generator_states"


def _discarded_cpu_generators(runner) -> dict:
    """{batch index: generator} for this step's discarded requests with a CPU generator."""
    num_reqs = runner.input_batch.num_reqs
    discard_indices = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    generators = runner.input_batch.generators
    found = {}
    for i in map(int, discard_indices):
        gen = generators.get(i)
        if gen is not None and gen.device.type == "cpu":
            found[i] = gen
    return found


def _make_sample(original):
    def _sample(self, *args, **kwargs):
        states = {i: gen.get_state() for i, gen in _discarded_cpu_generators(self).items()}
        setattr(self, SNAPSHOT_ATTR, states)
        return original(self, *args, **kwargs)

    return _sample


def _make_bookkeeping_sync(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        states = getattr(self, SNAPSHOT_ATTR, None) or {}
        setattr(self, SNAPSHOT_ATTR, None)
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in states if i in generators}
        for i, gen in hidden.items():
            gen.set_state(states[i])  # the rewind: as if this step never sampled
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    return _bookkeeping_sync


def apply() -> None:
    _util.wrap(MODULE, "GPUModelRunner._sample", _make_sample, NAME)
    _util.wrap(MODULE, "GPUModelRunner._bookkeeping_sync", _make_bookkeeping_sync, NAME)
