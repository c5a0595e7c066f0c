"""TriForceProposer: the three levels on vLLM's paged blocks (V1 model runner, vLLM 0.32.0).

A subclass of vLLM's `DraftModelProposer` (vllm/v1/spec_decode/draft_model.py) so every
`isinstance` check in the runner holds; vLLM still schedules, verifies (its own rejection
sampler, with our middle-level probabilities as draft probs) and commits. Per step, after
vLLM's full-cache verification pass:

1. commit   -- keys of tokens that are now final go into the per-block summaries
               (RetrievalLevel.begin_step, engine/retrieval_level.py, which makes the
               step's RetrievalStep; engine/summary_keeper.py);
2. plan     -- each decoding request's depth k, 0 .. gamma2 (vLLM's bound for the step:
               num_speculative_tokens, or Dynamic SD's entry for the batch size), and
               whether the small draft runs this step (DepthChooser, engine/depth.py, from
               measured costs and acceptance, core/controller.py). A request at depth 0
               decodes plainly, with no middle work; so does, by rule, one whose context
               fits the retrieval budget, and a seeded request's depth reads no clock.
               At a fixed depth (`adaptive` off: gamma2; or `set_fixed_depth`) every
               decoding request gets it and every level runs, as in fixed-gamma
               TriForce. Either way a request whose sampling needs vLLM's plain
               sampler (`decodes_plainly`) gets 0, and so does every request past the
               drafting cap (`cap_drafting`, seeded requests first);
3. select   -- drafting requests due for a refresh re-score their blocks
               (RetrievalStep.select, core/selection.py) with the newest committed token's
               query; between middle rounds, with the newest middle token's
               (RetrievalStep.select_in_middle);
4. middle loop (MiddleLoop.run, engine/middle.py), until each decoding request holds its
   depth in middle tokens:
     level 1: the small draft over its StreamingLLM table proposes up to gamma1 tokens per
              round (DraftLevel, engine/draft_level.py); without a small draft, or on a
              step it sits out, level 2 drafts alone, one token per round;
     level 2: the target over per-layer retrieval tables scores them (zero-copy: a
              different block table per layer through the stock attention backend);
     exact speculative sampling between the two (core/verify.py);
5. hand-off -- vLLM gets each request's k drafts (a list per request, [] at depth 0, with
   `adaptive` on or off) and, as draft probs, the level-2 distribution each token was drawn
   from, so level 3 (vLLM's verification over the full cache) stays lossless.

What steps 1-5 run on and keep between steps is `Drafting` (engine/drafting.py), which
Model Runner V2's host (engine/mrv2/speculator.py) shares; this class is its V1 host:
vLLM's calls, the step's batch read from the V1 runner, the hand-off as V1 takes it. The
engine's sizes (geometry, gamma1 / gamma2, drafting cap, pass limits) are worked out once,
in `EngineShape.of` (engine/shape.py), and handed down; the memory plan follows from that
shape with the runner's KV bytes per block and backend (`EngineShape.memory_plan`). The
levels are built in `initialize_attn_backend`, each with exactly what it uses. Of the
engine, only this class and `StepBatch.from_runner` (engine/batch.py, once per step) read
the runner; only this class reads the `DraftModelProposer` base class's attributes.

Tensor parallelism: every rank runs this code. Selections may differ per rank (each rank
scores its own KV heads), but every decision that shapes a collective -- which requests
draft, how many rounds, refreshes -- is the same on all ranks: the depth plan, which rests
on each rank's own clocks, is rank 0's, broadcast (engine/depth.py); everything else
derives from sampled tokens and acceptance counts, which come from all-gathered logits
and identically seeded generators.
"""

from __future__ import annotations

import contextlib
import time

from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_triforce import engine_settings
from vllm_triforce.engine.adapters import PassAdapters
from vllm_triforce.engine.batch import StepBatch
from vllm_triforce.engine.drafting import Drafting


class TriForceProposer(Drafting, DraftModelProposer):
    # A step in which no request was handed a draft runs vLLM's plain sampler
    # (patches/zero_draft.py): free when the depth controller keeps every request plain.
    PLAIN_STEPS_WITHOUT_DRAFTS = True

    def __init__(self, vllm_config, device, runner=None):
        engine_settings.check_effective(vllm_config)  # before any weights load
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.runner = runner
        self._last_draft_probs = None
        self._last_draft_prob_req_ids: list[str] | None = None
        # vLLM's pass, decided during it (`_reads_pass`): (its facts, a plain step), or None
        self._pass_plan: tuple | None = None
        # where only the depth controller's choice stands between a step and a plain one,
        # ask it during vLLM's pass (engine/plain_steps.py `plan_ahead`): a step it keeps
        # plain then costs what any plain step does (no sync, the pass not recorded)
        self.plan_ahead = True
        self._init_drafting(vllm_config, device)

    # ---- Drafting's reads of the runner ---------------------------------------------
    def _live_requests(self):
        return self.runner.requests

    def _kv_cache_specs(self) -> dict:
        return self.runner.get_kv_cache_spec()

    def _draft_parts(self):
        return self.model, self.draft_attn_groups, self._draft_attn_layer_names

    def _pass_adapters(self):
        return None if self.vllm_config.lora_config is None else PassAdapters(self.runner)

    # ---- vLLM lifecycle ------------------------------------------------------------
    def load_model(self, target_model) -> None:
        target_names = set(get_layers_from_vllm_config(self.vllm_config, Attention))
        if self.shape.has_draft:
            with _image_token_index(target_model):
                super().load_model(target_model)
        else:  # two levels: the target drafts for itself; load nothing twice
            self.model = None
            self._draft_attn_layer_names = set()
        self._attach_target(target_model, target_names)
        self.layer_capture.reads_pass = self._reads_pass

    def propose_plain_step(self) -> list[list[int]] | None:
        """Before vLLM prepares `propose`'s inputs (patches/plain_propose.py): a step
        decided plain during vLLM's pass is done here, and its empty drafts returned;
        None for any other (`propose` follows, with the decision kept)."""
        plan = self._pass_plan
        if plan is None or not plan[1]:
            return None
        plan = self._take_plan(self.runner.input_batch.num_reqs)
        return None if plan is None else self._plain_step(plan[0], time.perf_counter())

    def _take_plan(self, num_reqs: int) -> tuple | None:
        """The plan `_reads_pass` made during this step's pass (None: none, or not this
        pass's, which has `num_reqs` requests), taken: a plan serves one step."""
        plan, self._pass_plan = self._pass_plan, None
        return plan if plan is not None and len(plan[0].req_ids) == num_reqs else None

    def _plain_step(self, facts, start: float) -> list[list[int]]:
        """A plain step (engine/plain_steps.py): its timing and counters, no device value
        read, no batch built; no drafts."""
        self._last_draft_probs, self._last_draft_prob_req_ids = None, None
        self.plain_steps.record(facts, self.runner.requests, start)
        self._plain_step_done(start)
        return [[] for _ in facts.req_ids]

    def _reads_pass(self) -> bool:
        """At vLLM's pass's first layer: whether this step reads the pass (not a plain
        step, engine/plain_steps.py), from the same host facts `propose` reads after it,
        which then takes this answer: a pass not recorded is never worked on."""
        self.depth.forget_plan_ahead()  # one a pass, and only this pass's
        facts = self.plain_steps.read_v1_ahead(self.runner)
        requests = self.runner.requests
        plain = self.plain_steps.is_plain(facts, requests, self._handed_last)
        if not plain and self.plan_ahead:
            plain = self.plain_steps.plan_ahead(
                facts, requests, self._handed_last, self.shape.gamma2,
                seeded=bool(self.runner.input_batch.generators))
        self._pass_plan = (facts, plain)
        return not plain

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        if self.shape.has_draft and len(kv_cache_config.kv_cache_groups) == 1:
            super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        self._build_drafting(kv_cache_config,
                             [g for groups in self.runner.attn_groups for g in groups])

    def dummy_run(self, num_tokens, *args, **kwargs) -> None:
        self._compile_after_binding()  # warm-up runs after vLLM bound its KV cache
        if self.shape.has_draft:
            super().dummy_run(num_tokens, *args, **kwargs)

    def take_last_draft_probs(self):
        return self._last_draft_probs

    def last_draft_prob_req_ids(self) -> list[str] | None:
        """The request of each row of `take_last_draft_probs()` (patches/handoff_rows.py)."""
        return self._last_draft_prob_req_ids

    # ---- one step -------------------------------------------------------------------
    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                num_rejected_tokens_gpu=None, slot_mappings=None) -> list[list[int]]:
        self._last_draft_probs, self._last_draft_prob_req_ids = None, None
        start = time.perf_counter()
        plan = self._take_plan(common_attn_metadata.num_reqs)
        if plan is None:  # not decided during the pass: now, from the same facts
            facts = self.plain_steps.read_v1(self.runner, common_attn_metadata)
            plan = facts, self.plain_steps.is_plain(facts, self.runner.requests,
                                                    self._handed_last)
        facts, plain = plan
        if plain:
            return self._plain_step(facts, start)
        batch = StepBatch.from_runner(self.runner, common_attn_metadata, target_token_ids,
                                      next_token_ids, num_rejected_tokens_gpu,
                                      sampling_metadata, self.block_size,
                                      num_speculative_tokens, previous=self._last_batch,
                                      table_group=self.table_group,
                                      window_groups=self.windows and self.windows.block_sizes)
        drafts, probs, prob_req_ids = self._run_step(batch, start, num_speculative_tokens)
        self._last_draft_probs, self._last_draft_prob_req_ids = probs, prob_req_ids
        # one list per request, [] allowed (vLLM's variable-length path), also at a fixed
        # depth: a request over the drafting cap, or prefilling, gets no draft
        return drafts


@contextlib.contextmanager
def _image_token_index(target_model):
    """vLLM's draft-model loader (`SpecDecodeBaseProposer.load_model`, 0.32.0 and 0.33.0)
    copies a multimodal target's image token onto the draft's config: by name for the
    models it lists, else from `config.image_token_index`, which PaddleOCR-VL's and
    Qwen2-VL's configs do not have (they name it `image_token_id`), so loading a small
    draft for them failed with AttributeError. TriForce's small draft reads no image
    embeddings (it drafts from text); during the load, such a config gets
    `image_token_index` from its `image_token_id`, and loses it afterwards."""
    config = getattr(target_model, "config", None)
    lend = (config is not None and not hasattr(config, "image_token_index")
            and getattr(config, "image_token_id", None) is not None)
    if lend:
        config.image_token_index = config.image_token_id
    try:
        yield
    finally:
        if lend:
            del config.image_token_index
