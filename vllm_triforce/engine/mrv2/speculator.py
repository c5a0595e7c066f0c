"""TriForce's speculator, runner and worker for Model Runner V2 (vLLM 0.32.0 and 0.33.0):
the binding's classes, importable anywhere, runnable only on a GPU (MRV2's per-step
kernels are Triton), and wired into nothing yet: no patch and no setting selects them.

How they would sit in vLLM (vllm/v1/worker/, 0.32.0 and 0.33.0):
- `TriForceWorker(Worker)` overrides `_make_model_runner`, the hook whose docstring says
  "subclasses override this" (gpu_worker.py), to build a `TriForceRunnerV2` when MRV2 runs
  a TriForce config; selected through vLLM's `worker_cls`;
- `TriForceRunnerV2(GPUModelRunner)` (gpu/model_runner.py) replaces the speculator that
  `init_speculator` built (a hard-coded chain: `draft_model` -> StandaloneARSpeculator) by a
  `TriForceSpeculator`, and the draft-token handler by `DraftCounts` (per-request counts),
  and feeds the speculator's `RequestRecords` from each scheduler output;
- `TriForceSpeculator(StandaloneARSpeculator)` keeps every `isinstance(...,
  DraftModelSpeculator)` in the runner true (draft loading, `set_attn`, the draft's KV
  layers) and answers `propose` with drafts [R, K] in columns [0, k_r) of request r.

What `propose` does today: builds the step's `StepBatch` (`from_mrv2`) and commits its
tokens to the records, then hands every request depth 0: each step is a plain decode, the
output plain vLLM's. Running the levels (capture hook, retrieval and draft levels, the
middle loop with `keep_logits`, the depth chooser, the memory reservation) is the GPU
binding's next step, listed in docs/ARCHITECTURE.md ("Which runner").
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator
from vllm.v1.worker.gpu_worker import Worker

from vllm_triforce.config import TriForceConfigError, triforce_settings
from vllm_triforce.engine.batch import StepBatch
from vllm_triforce.engine.mrv2.draft_logits import DraftLogitsBuffer
from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts
from vllm_triforce.engine.mrv2.requests import RequestRecords
from vllm_triforce.engine.shape import EngineShape


class TriForceSpeculator(StandaloneARSpeculator):
    """MRV2's speculator contract (`BaseSpeculator.propose` -> [R, K] draft ids on the
    device), with TriForce's host records and per-request counts. Without a small draft
    (two levels) nothing is loaded: the target drafts for itself."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.shape = EngineShape.of(vllm_config)
        if self.shape is None:
            raise TriForceConfigError("TriForceSpeculator needs an engine configured with "
                                      "\"method\": \"triforce\" (no TriForce settings found).")
        self.records = RequestRecords()
        self.draft_counts: DraftCounts | None = None  # the runner's handler
        self.sampling_states = None  # the runner's `sampler.sampling_states`, after loading
        self.logits_buffer: DraftLogitsBuffer | None = None
        if self.draft_logits is not None:  # draft_sample_method "probabilistic"
            # the same [max_num_reqs, K, V] in the same dtype, plus a spare row
            self.logits_buffer = DraftLogitsBuffer(*self.draft_logits.shape,
                                                   dtype=self.draft_logits.dtype,
                                                   device=device)
            self.draft_logits = self.logits_buffer.logits
        self._last_batch: StepBatch | None = None

    def load_model(self, target_model) -> None:
        self.target_model = target_model
        if self.shape.has_draft:
            super().load_model(target_model)
            return
        self.model = None  # two levels: load nothing, no draft KV layers
        self.draft_attn_layer_names = set()
        self.supports_mm_inputs = False

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers,
                 target_attn_groups) -> None:
        if self.shape.has_draft:
            super().set_attn(model_state, kv_cache_config, block_tables,
                             target_input_buffers, target_attn_groups)
            return
        self.model_state, self.kv_cache_config = model_state, kv_cache_config
        self.block_tables, self.attn_groups = block_tables, []
        self.target_input_buffers = target_input_buffers
        self.target_attn_groups = target_attn_groups

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False, num_speculative_tokens=None):
        num_reqs = input_batch.num_reqs
        drafts = self.draft_tokens[:num_reqs]  # [R, K]: request r's drafts in [0, k_r)
        drafts.fill_(-1)
        if dummy_run or is_profile:  # vLLM's own batches: no request of ours
            self.draft_counts.set_depths([], [])
            return drafts
        max_depth = (self.num_speculative_steps if num_speculative_tokens is None
                     else num_speculative_tokens)
        batch = StepBatch.from_mrv2(
            input_batch, num_sampled, num_rejected, last_sampled, self.sampling_states,
            self.block_tables.input_block_tables[0], self.records, self.shape.block_size,
            max_depth, previous=self._last_batch)
        self.records.commit(batch)
        self._last_batch = batch
        self.draft_counts.set_depths(batch.req_ids, [0] * num_reqs)  # the levels: next step
        return drafts


class TriForceRunnerV2(GPUModelRunnerV2):
    """MRV2's runner with TriForce's speculator and per-request draft counts."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.draft_tokens_handler = DraftCounts(self.draft_tokens_handler)
        if self.speculator is not None:  # the last pipeline rank drafts
            # replaces StandaloneARSpeculator before any weights load
            self.speculator = TriForceSpeculator(vllm_config, self.device)
            self.speculator.draft_counts = self.draft_tokens_handler

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        if self.speculator is not None:
            self.speculator.sampling_states = self.sampler.sampling_states
        return out

    def update_requests(self, scheduler_output) -> None:
        """After the runner's own finish / add / update of this output (execute_model's
        order), the speculator's records follow it."""
        super().update_requests(scheduler_output)
        if self.speculator is not None:
            self.speculator.records.apply(scheduler_output)


class TriForceWorker(Worker):
    """vLLM's GPU worker, building `TriForceRunnerV2` for a TriForce config on MRV2."""

    def _make_model_runner(self):
        if self.use_v2_model_runner and triforce_settings(self.vllm_config) is not None:
            return TriForceRunnerV2(self.vllm_config, self.device)
        return super()._make_model_runner()
