"""Put the TriForce proposer into vLLM's V1 model runner.

Why a patch: vLLM 0.32's `GPUModelRunner.__init__` (vllm/v1/worker/gpu_model_runner.py,
also the base of `CPUModelRunner`) picks its proposer from a hard-coded if/elif on the
method name; there is no proposer registry (RFC vllm#36219 is open) and 0.32 has no
worker-extension hook that runs after the runner is built. The spec_config patch makes a
TriForce config look like `draft_model` to vLLM; this wrapper then swaps the
`DraftModelProposer` the runner built for a `TriForceProposer` (a subclass, so every
`isinstance(..., DraftModelProposer)` in the runner still holds) before any model loads.
It also lifts `effective_drafter_max_model_len`: TriForce's draft sees rebased positions,
so the runner must not stop drafting at the draft's trained context.

Why not vLLM 0.32's one pluggable proposer, `"method": "custom_class"` (`SpeculativeConfig.
__post_init__` in vllm/config/speculative.py, `create_custom_proposer` in
vllm/v1/spec_decode/custom_class_proposer.py): it is built from the `VllmConfig` alone (no
device, no runner), its `draft_model_config` is the target's (no draft model is loaded), and
`initialize_attn_backend` is called only for EAGLE and draft-model proposers. Each step,
`GPUModelRunner.propose_draft_token_ids` calls it after bookkeeping as
`propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu,
slot_mappings=...)`: host lists of the sampled ids and token histories, and slot mappings.
It never gets what TriForce steps from: the verification pass's `CommonAttentionMetadata`
(block table, seq_lens, query_start_loc), `num_rejected_tokens_gpu`, the sampling metadata
(temperature, top-k, top-p) or the target's hidden states; nor can it return draft
probabilities, since `take_last_draft_probs` is read only on the EAGLE/draft-model path, so the
rejection sampler would treat its drafts as one-hot. (The per-layer queries and keys reach no
proposer at all: TriForce's attention-capture hook records them.)
"""

from vllm_triforce.patches import _util

NAME = "runner"
TARGET = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__")


def apply() -> None:
    _util.wrap(*TARGET, _make_wrapper, NAME)


def _make_wrapper(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_triforce.config import triforce_settings

        if triforce_settings(vllm_config) is None or not hasattr(self, "drafter"):
            return
        from vllm_triforce.engine.proposer import TriForceProposer

        self.drafter = TriForceProposer(vllm_config, self.device, runner=self)
        self.effective_drafter_max_model_len = self.max_model_len

    return __init__
