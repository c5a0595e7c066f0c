"""TriForce's speculator, runner and worker for Model Runner V2 (vLLM 0.32.0 and 0.33.0):
importable anywhere, runnable only on a GPU (MRV2's per-step kernels are Triton), and
selected only by the experimental switch `VLLM_TRIFORCE_MRV2=1` or an explicit
`VLLM_USE_V2_MODEL_RUNNER=1` (engine_settings.py), off by default until a GPU lease shows
it exact.

How they sit in vLLM (vllm/v1/worker/, 0.32.0 and 0.33.0):
- `TriForceWorker(Worker)` overrides `_make_model_runner`, the hook whose docstring says
  "subclasses override this" (gpu_worker.py), to build a `TriForceRunnerV2` when MRV2 runs
  a TriForce config; selected through vLLM's `worker_cls`;
- `TriForceRunnerV2(GPUModelRunner)` (gpu/model_runner.py) replaces the speculator that
  `init_speculator` built (a hard-coded chain: `draft_model` -> StandaloneARSpeculator) by a
  `TriForceSpeculator`, and the draft-token handler by `DraftCounts` (per-request counts),
  feeds the speculator's `RequestRecords` from each scheduler output, and under async
  scheduling cuts each request's scheduled drafts to its depth (`DraftCounts.trimmed`);
- `TriForceSpeculator(Drafting, StandaloneARSpeculator)` keeps every `isinstance(...,
  DraftModelSpeculator)` in the runner true (draft loading, `set_attn`, the draft's KV
  layers), runs TriForce's levels (engine/drafting.py, the V1 proposer's own) and answers
  `propose` with drafts [R, K] in columns [0, k_r) of request r.

What `propose` does: a step the host finds nothing to do in (engine/plain_steps.py, from
the pass's `InputBatch` host arrays), or one the depth controller, asked before any
batch is built, keeps plain (`plan_ahead`), hands every request depth 0 with no batch and
no device read. Any other step builds its `StepBatch` (`from_mrv2`), commits its tokens to
the records (those of the requests' plain steps from vLLM's token history), runs the step
(commit, plan, select, middle loop) and hands the drafts over.
MRV2's verifier takes a draft distribution only as logits in `draft_logits`, which it
allocates with draft_sample_method "probabilistic" (the switch sets it,
engine_settings.mrv2_keys; without it the speculator refuses to start): the middle level
draws from softmax(logits / T) (`temperature_only`) and each round writes the logits its
tokens were drawn from at (slot, step) (`keep_logits`, through the hand-off buffer).
"""

from __future__ import annotations

import time

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.worker.gpu.attn_utils import get_varlen_cudagraph_unsupported_backend
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator
from vllm.v1.worker.gpu_worker import Worker

from vllm_triforce import engine_settings
from vllm_triforce.config import TriForceConfigError, triforce_settings
from vllm_triforce.core.verify import GREEDY_TEMPERATURE
from vllm_triforce.engine.batch import StepBatch
from vllm_triforce.engine.drafting import Drafting
from vllm_triforce.engine.mrv2.draft_logits import DraftLogitsBuffer, temperature_only
from vllm_triforce.engine.mrv2.draft_tokens import DraftCounts, note_cut
from vllm_triforce.engine.mrv2.graphs import (CaptureDemotion, takes_full_decode,
                                              use_varlen_decode)
from vllm_triforce.engine.mrv2.requests import RequestRecords, TokenHistory
from vllm_triforce.engine.plain_steps import PlainSteps


logger = init_logger("vllm.triforce")


class TriForceSpeculator(Drafting, StandaloneARSpeculator):
    """MRV2's speculator contract (`BaseSpeculator.propose` -> [R, K] draft ids on the
    device), over TriForce's levels, with its host records and per-request counts.
    Without a small draft (two levels) nothing is loaded: the target drafts for itself."""

    def __init__(self, vllm_config, device):
        engine_settings.check_effective(vllm_config)  # before any weights load
        super().__init__(vllm_config, device)
        self.records = RequestRecords()
        self.draft_counts: DraftCounts | None = None  # the runner's handler
        self.sampling_states = None  # the runner's `sampler.sampling_states`, after loading
        self.kv_cache_specs = None  # the runner's `get_kv_cache_spec`
        self.token_history: TokenHistory | None = None  # the runner's `req_states`
        # whether the coming pass is a plain step, decided before it (`plan_pass`) when
        # the runner chooses its CUDA graph by it (engine/mrv2/graphs.py); None: not asked
        self._pass_plain: bool | None = None
        # where only the depth controller's choice stands between a step and a plain one,
        # ask it before the step's batch is built (engine/plain_steps.py `plan_ahead`): a
        # step it keeps plain then costs what any plain step does (no device read, and
        # with FULL decode graphs the pass replays as one); False turns it off
        self.plan_ahead = True
        if self.draft_logits is None:  # its verifier would take every draft as one-hot
            raise TriForceConfigError(
                "TriForce on Model Runner V2 needs vLLM's draft_sample_method "
                "'probabilistic' (VLLM_TRIFORCE_MRV2=1 sets it; this config has "
                f"{self.speculative_config.draft_sample_method!r})")
        # the same [max_num_reqs, K, V] in the same dtype, plus a spare row
        self.logits_buffer = DraftLogitsBuffer(*self.draft_logits.shape,
                                               dtype=self.draft_logits.dtype, device=device)
        self.draft_logits = self.logits_buffer.logits
        self._init_drafting(vllm_config, device, hands_off_probs=False)

    # ---- Drafting's reads of the runner ---------------------------------------------
    def _live_requests(self):
        return self.records

    def _kv_cache_specs(self) -> dict:
        return self.kv_cache_specs()

    def _draft_parts(self):
        return (self.model, [g for groups in self.attn_groups for g in groups],
                self.draft_attn_layer_names)

    # ---- vLLM lifecycle ------------------------------------------------------------
    def load_model(self, target_model) -> None:
        if self.shape.has_draft:
            super().load_model(target_model)
        else:  # two levels: load nothing, no draft KV layers
            self.model = None
            self.draft_attn_layer_names = set()
            self.supports_mm_inputs = False
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        self._attach_target(target_model, set(layers) - self.draft_attn_layer_names)

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers,
                 target_attn_groups) -> None:
        if self.shape.has_draft:
            super().set_attn(model_state, kv_cache_config, block_tables,
                             target_input_buffers, target_attn_groups)
        else:
            self.model_state, self.kv_cache_config = model_state, kv_cache_config
            self.block_tables, self.attn_groups = block_tables, []
            self.target_input_buffers = target_input_buffers
            self.target_attn_groups = target_attn_groups
        self._build_drafting(kv_cache_config,
                             [g for groups in target_attn_groups for g in groups])
        self._probs_buffer.logits = self.logits_buffer  # the middle rounds write it

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False, num_speculative_tokens=None):
        num_reqs = input_batch.num_reqs
        if (dummy_run or is_profile) and self.shape.has_draft:
            # vLLM's own batches: the small draft runs over them as vLLM's draft model
            # would, so that its activations are in the profile (the V1 proposer's
            # `dummy_run` alike); its drafts are dropped below
            super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                            aux_hidden_states, num_sampled, num_rejected, last_sampled,
                            next_prefill_tokens, temperature, seeds, dp_sync_state,
                            dummy_run=dummy_run,
                            skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                            mm_inputs=mm_inputs, is_profile=is_profile,
                            num_speculative_tokens=num_speculative_tokens)
        drafts = self.draft_tokens[:num_reqs]  # [R, K]: request r's drafts in [0, k_r)
        drafts.fill_(-1)
        if dummy_run or is_profile:  # no request of ours
            self.draft_counts.set_depths([], [])
            return drafts
        start = time.perf_counter()
        max_depth = (self.num_speculative_steps if num_speculative_tokens is None
                     else num_speculative_tokens)
        plain, self._pass_plain = self._pass_plain, None  # decided before the pass, or now
        if plain is not False:  # a plain step, or one not decided yet
            facts = self.plain_steps.read_mrv2(input_batch)
            if plain is None:
                plain = self._is_plain(facts, input_batch.idx_mapping_np[:num_reqs],
                                       max_depth)
            if plain:
                self.plain_steps.record(facts, self.records, start)
                self.draft_counts.set_depths(facts.req_ids, [0] * num_reqs)  # all plain
                self._plain_step_done(start)  # no device value read, no batch built
                return drafts
        batch = StepBatch.from_mrv2(
            input_batch, num_sampled, num_rejected, last_sampled, self.sampling_states,
            self.block_tables.input_block_tables[0], self.records, self.shape.block_size,
            max_depth, previous=self._last_batch)
        # tokens of the requests' plain steps come from vLLM's history of them
        self.records.commit(batch, input_batch.idx_mapping_np[:num_reqs], self.token_history)
        # the middle level draws from the q MRV2's verifier assumes
        lists, _, _ = self._run_step(temperature_only(batch), start, max_depth)
        self.draft_counts.set_depths(batch.req_ids, [len(d) for d in lists])
        put_drafts(drafts, lists)
        return drafts

    def plan_pass(self, facts, slots) -> bool:
        """Before vLLM's pass (its `PassFacts`, its requests' `slots`): whether it is a
        plain step, which reads nothing of the pass. `propose` takes this same answer for
        the step, so a pass the runner let replay as a FULL graph (no capture) is never
        worked on."""
        self._pass_plain = self._is_plain(facts, slots, self.num_speculative_steps)
        return self._pass_plain

    def _is_plain(self, facts, slots, max_depth: int) -> bool:
        """Whether the pass is a plain step: one with nothing to do (`is_plain`), or, where
        only the depth controller's choice stands between it and one, one the controller,
        asked now, gives every decoding request depth 0 (`PlainSteps.plan_ahead`; the plan
        is kept for the step either way). `slots`: the requests' rows of the sampler's
        states, where a seeded request is found."""
        self.depth.forget_plan_ahead()  # one a pass, and only this pass's
        if self.plain_steps.is_plain(facts, self.records, self._handed_last):
            return True
        return self.plan_ahead and self.plain_steps.plan_ahead(
            facts, self.records, self._handed_last, max_depth,
            seeded=self._any_seeded(slots))

    def _any_seeded(self, slots) -> bool:
        """Whether a request at `slots` samples from a seed of its own (vLLM's
        RANDOM_SEED requests: a seed and a temperature; `StepBatch.from_mrv2`'s test)."""
        states = self.sampling_states
        return bool((states.seeds_set[slots]
                     & (states.temperature.np[slots] >= GREEDY_TEMPERATURE)).any())


def put_drafts(drafts: torch.Tensor, lists: list[list[int]]) -> None:
    """Request r's draft list into drafts[r, :len(lists[r])] (the rest stays -1), in one
    host-to-device copy, and none when nobody drafts."""
    if not any(lists):
        return
    rows = torch.full(drafts.shape, -1, dtype=drafts.dtype)
    for r, ids in enumerate(lists):
        rows[r, :len(ids)] = torch.tensor(ids, dtype=drafts.dtype)
    drafts.copy_(rows.to(drafts.device, non_blocking=True))


class TriForceRunnerV2(GPUModelRunnerV2):
    """MRV2's runner with TriForce's speculator and per-request draft counts."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.capture_demotion: CaptureDemotion | None = None  # FULL decode graphs only
        self.draft_tokens_handler = DraftCounts(self.draft_tokens_handler)
        if self.speculator is not None:  # the last pipeline rank drafts
            # replaces StandaloneARSpeculator before any weights load
            self.speculator = TriForceSpeculator(vllm_config, self.device)
            self.speculator.draft_counts = self.draft_tokens_handler
            self.speculator.kv_cache_specs = self.get_kv_cache_spec
            self.speculator.token_history = TokenHistory(self.req_states.all_token_ids.gpu)

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        if self.speculator is not None:
            self.speculator.sampling_states = self.sampler.sampling_states
        return out

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        """vLLM's, then, with FULL decode graphs asked for (cudagraph_mode
        FULL_AND_PIECEWISE), variable-length ones, dispatched piecewise for every pass
        TriForce reads (engine/mrv2/graphs.py)."""
        super().initialize_kv_cache(*args, **kwargs)
        if self.speculator is not None:  # the cache is bound to the layers now
            self.speculator._compile_after_binding()
        self.capture_demotion = None
        if self.speculator is not None and takes_full_decode(self.cudagraph_manager):
            # every backend replays any mix of 1 .. 1 + K tokens per request (FLASH_ATTN);
            # else only uniform 1 + K batches replay FULL, when TriForce reads nothing
            unsupported = get_varlen_cudagraph_unsupported_backend(
                self.attn_groups, self.vllm_config, self.decode_query_len)
            if unsupported is None:
                use_varlen_decode(self.cudagraph_manager)
            self.capture_demotion = CaptureDemotion(self.cudagraph_manager)
            self.speculator.layer_capture.skip_while_capturing = True
            logger.info("TriForce: FULL decode graphs (%s) for the passes it reads nothing "
                        "of, piecewise graphs for the others (experimental)",
                        "1 to %d tokens a request" % self.decode_query_len
                        if unsupported is None else
                        "%d tokens a request only: %s replays no other" % (
                            self.decode_query_len, unsupported[0]))

    def gather_batch_req_state(self, scheduler_output, dummy_run):
        """vLLM's, and with FULL decode graphs the speculator's decision whether this pass
        is read (then it runs piecewise)."""
        state, uniform = super().gather_batch_req_state(scheduler_output, dummy_run)
        demotion = self.capture_demotion
        if demotion is not None:
            demotion.needs_capture = state is not None and not self.speculator.plan_pass(
                PlainSteps.read_mrv2_ahead(state, self.req_states.num_computed_tokens_np),
                state.idx_mapping_np)
        return state, uniform

    def execute_model(self, scheduler_output, *args, **kwargs):
        """vLLM's step, with each request's scheduled drafts cut to the depth TriForce
        gave it at the last step (async scheduling schedules K for everyone:
        engine/mrv2/draft_tokens.py), on a copy of the scheduler's output; the cut slots
        are noted on the scheduler's own, for vLLM's metrics (`note_cut`)."""
        if self.speculator is not None and not kwargs.get("dummy_run", False):
            cut = self.speculator.draft_counts.trimmed(scheduler_output)
            if cut is not scheduler_output:
                note_cut(scheduler_output, cut)
            scheduler_output = cut
        return super().execute_model(scheduler_output, *args, **kwargs)

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
