"""What TriForce does between vLLM's verification passes, whichever model runner hosts it.

`Drafting` is a mixin of the two hosts: `TriForceProposer` (engine/proposer.py, vLLM's
V1 runner, on CPU and GPU) and `TriForceSpeculator` (engine/mrv2/speculator.py, Model
Runner V2, GPU only). It holds the engine's shape, the three levels, the request states,
the depth controller and the counters, and runs a step from a `StepBatch` (engine/batch.py,
which each host builds from its own runner's state): commit, plan, select, middle loop,
hand-off (engine/proposer.py's docstring walks through them). A host keeps what is its
runner's: its vLLM base class, when it is called, how a step's batch is read, how the
drafts and their distributions go back.

A host calls `_init_drafting` in its `__init__`, `_attach_target` when the target's
weights are loaded, `_build_drafting` when the KV cache exists, and `_run_step` once a
step; it provides `self.vllm_config`, `self.device` and three reads of its runner:

- `_live_requests()`: req_id -> the request as the engine reads it (V1's
  `CachedRequestState`, MRV2's `RequestRecord`), for every request the runner holds;
- `_kv_cache_specs()`: the runner's KV-cache specs (`get_kv_cache_spec()`);
- `_draft_parts()`: the small draft's (model, attention groups, layer names), or None
  with two levels;

and, where it takes LoRA adapters, `_pass_adapters()` (engine/adapters.py).

No attribute or method here shares a name with vLLM's V1 proposer or MRV2 speculator
classes (both have `capture`: this keeps the query/key capture as `layer_capture`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index

from vllm_triforce import engine_settings, metrics
from vllm_triforce.compat import moved
from vllm_triforce.config import TriForceConfigError, forced_settings
from vllm_triforce.core.compiled import first_line
from vllm_triforce.core.compiled_sampling import CompiledSampling
from vllm_triforce.core.fused_reads import CompiledScores
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.refresh import RefreshPolicy
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.engine.batch import StepBatch, of_rows
from vllm_triforce.engine.depth import DepthChooser
from vllm_triforce.engine.device import capture
from vllm_triforce.engine.device.forward import (BUILDER_PER_LAYER, WindowLayers, metadata_path,
                                                 takes_mrope)
from vllm_triforce.engine.device.round_graph import RoundGraphs, WindowGroup
from vllm_triforce.engine.device.selection_graph import SelectionGraphs
from vllm_triforce.engine.draft_level import DraftLevel, draft_window
from vllm_triforce.engine.memory import (MemoryPlan, Sizing, allocate_summaries,
                                         check_one_request, describe_reservation)
from vllm_triforce.engine.middle import HandOffBuffer, MiddleLoop, hand_off
from vllm_triforce.engine.paged_keys import paged_keys_for
from vllm_triforce.engine.plain_steps import PlainSteps
from vllm_triforce.engine.retrieval_level import LAUNCH_AHEAD_ENV, RetrievalLevel
from vllm_triforce.engine.shape import EngineShape
from vllm_triforce.engine.state import RequestState, StateTable
from vllm_triforce.engine.stats import TriForceStats
from vllm_triforce.engine.summary_keeper import SummaryKeeper

logger = init_logger("vllm.triforce")


class Drafting:
    """The engine's state and its step, for a host (module docstring)."""

    # ---- the host's reads of its runner -------------------------------------------
    def _live_requests(self):
        raise NotImplementedError

    def _kv_cache_specs(self) -> dict:
        raise NotImplementedError

    def _draft_parts(self):
        raise NotImplementedError

    def _pass_adapters(self):
        """What maps TriForce's passes to vLLM's LoRA adapters (engine/adapters.py), or
        None: LoRA off, or a host without it."""
        return None

    # ---- set-up ---------------------------------------------------------------------
    def _init_drafting(self, vllm_config, device, hands_off_probs: bool = True) -> None:
        """Everything that needs only the config, before any weights load.
        `hands_off_probs`: the host hands vLLM draft probabilities as float32 rows (the V1
        runner; Model Runner V2 takes the logits, engine/mrv2/)."""
        shape = EngineShape.of(vllm_config)
        if shape is None:
            raise TriForceConfigError(f"{type(self).__name__} needs an engine configured with "
                                      "\"method\": \"triforce\" (no TriForce settings found).")
        self.shape = dataclasses.replace(shape, hands_off_probs=hands_off_probs)
        self.cfg = self.shape.cfg
        self.forced_settings = forced_settings(vllm_config)
        self.reserved_bytes = 0  # set by reserve_memory (patches/kv_reservation.py) ...
        self.sizing: Sizing | None = None  # ... with the limits it reserved for
        # set while vLLM sizes the KV cache (patches/kv_reservation.py): a build then is over
        # the minimal cache of vLLM's CUDA-graph memory profile, and compiles nothing
        self.sizing_kv_cache = False
        self._probs_buffer: HandOffBuffer | None = None
        if self.shape.has_draft:
            self._draft_window()  # refuse a window the draft's context cannot hold
        self.policy = make_policy(self.cfg.selection_policy, **self.cfg.policy_kwargs())
        self.refresh = RefreshPolicy(self.cfg.refresh_interval,
                                     self.cfg.refresh_acceptance_threshold)
        self.states = StateTable()
        self._last_batch: StepBatch | None = None  # what the next step's may take again
        self.stats = TriForceStats()
        self._metrics = metrics.Publisher(f"{os.getpid()}-{id(self)}", self.stats.snapshot)
        weakref.finalize(self, metrics.retire, self._metrics)
        self._published_live: int | None = None  # live requests at the last publish
        seed = vllm_config.model_config.seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0 if seed is None else seed)
        self.summaries: BlockSummaries | None = None
        self.layer_capture: capture.LayerCapture | None = None
        self.block_size: int | None = None
        # the KV-cache group TriForce selects blocks in, and the target's sliding-window
        # layers by group (engine/device/forward.py `WindowLayers`; None: it has none)
        self.table_group = 0
        self.windows: WindowLayers | None = None
        # The levels, built in _build_drafting (engine/retrieval_level.py,
        # engine/draft_level.py, engine/middle.py).
        self.retrieval: RetrievalLevel | None = None
        self.draft: DraftLevel | None = None
        self.middle: MiddleLoop | None = None
        self.depth: DepthChooser | None = None  # the depth controller (engine/depth.py)
        # the steps with nothing to do, found on the host (engine/plain_steps.py)
        self.plain_steps: PlainSteps | None = None
        self._handed_last = False  # the last step handed a request drafts
        logger.info("TriForce: %s levels, gamma2=%d, gamma1=%d, retrieval budget %d blocks of %d "
                    "tokens, policy %s%s", 3 if self.shape.has_draft else 2,
                    self.shape.gamma2, self.shape.gamma1, self.shape.blocks.budget_blocks,
                    self.shape.block_size, self.cfg.selection_policy,
                    " (mean key + key variance)" if self.cfg.summary_kinds().keep_variance
                    else "")

    def _attach_target(self, target_model, target_names) -> None:
        """The target's attention layers (`target_names`: their names, the draft's left
        out), in order, and the query/key capture on those TriForce selects blocks for:
        all of them, or, beside local layers (sliding-window: Gemma 2 and 3, gpt-oss;
        chunked: Llama 4; kept in `window_layer_names`), the full-attention ones."""
        self.target_model = target_model
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        names = sorted(target_names, key=extract_layer_index)
        windowed = [n for n in names if layers[n].sliding_window is not None
                    or getattr(layers[n], "attention_chunk_size", None)]  # Llama 4's
        if len(windowed) == len(names):  # one window in every layer, holding the context
            windowed = []  # (engine_settings.check_attention): they attend as full ones
        self.window_layer_names = windowed
        self.target_layer_names = [n for n in names if n not in windowed]
        self.target_layers = [layers[n] for n in self.target_layer_names]
        compilation = self.vllm_config.compilation_config
        why = capture.references_outlive_passes(compilation,
                                                self.vllm_config.model_config.enforce_eager)
        self.layer_capture = capture.install(self.target_layers,
                                             compilation.max_cudagraph_capture_size,
                                             copy_large_passes=bool(why))
        if why:
            logger.info("TriForce capture: %s, so a pass of more than %d tokens keeps copies "
                        "of its queries and keys, not references", why,
                        self.layer_capture.copy_tokens)

    def _build_drafting(self, kv_cache_config, target_groups: list) -> None:
        """The summaries, the hand-off buffer and the levels, over the KV cache vLLM made
        (`kv_cache_config`), whose attention groups are `target_groups` (flat)."""
        self.table_group, self.windows = self._kv_groups(kv_cache_config, target_groups)
        self.block_size = kv_cache_config.kv_cache_groups[
            self.table_group].kv_cache_spec.block_size
        shape = self.shape
        if self.block_size != shape.block_size or len(self.target_layers) != shape.num_layers:
            raise TriForceConfigError(
                f"TriForce was sized for {shape.num_layers} target layers in blocks of "
                f"{shape.block_size} tokens; vLLM's KV cache has {len(self.target_layers)} "
                f"and blocks of {self.block_size}. Please report this with your model.")
        self.sizing = self._agreed_sizing(kv_cache_config.num_blocks)
        self.summaries = allocate_summaries(  # what memory_plan reserved
            shape.kinds, num_layers=shape.num_layers,
            num_blocks=kv_cache_config.num_blocks, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, block_size=shape.block_size, dtype=shape.summary_dtype,
            device=self.device, chunk_bytes=self.sizing.chunk_bytes)
        # [D, gamma2, V]: the draft probabilities handed to vLLM, one row per request that may
        # draft (the drafting cap, `Sizing.drafting`: max_num_seqs, or what a small cache's
        # share holds), float32 as vLLM's rejection sampler reads them, reused per step
        # (patches/handoff_rows.py).
        self._probs_buffer = HandOffBuffer(self.sizing.drafting if shape.hands_off_probs
                                           else 0, shape.gamma2, shape.vocab_size,
                                           self.device)
        backend = target_groups[0].backend.get_name()
        metadata_path(backend)  # refuse an unsupported backend now, not at the first pass
        # Every policy's engine checks the reader once, at the first commit (SummaryKeeper):
        # the check decides lazy summaries (set from keys read back from this cache) and
        # whether `rerank` gets its exact stage; `doctor` reports the result.
        paged_keys, unreadable = paged_keys_for(
            self.target_layers, backend, self.block_size, self.vllm_config.cache_config.cache_dtype)
        if paged_keys is None and self.policy.exact_stage:
            logger.warning("TriForce: selection_policy %r cannot read keys from this KV cache "
                           "(%s); it keeps its first stage only.", self.policy.name,
                           unreadable)
        self._build_levels(paged_keys, unreadable, target_groups)
        if self.sizing_kv_cache and (self.cfg.compiled_sampling or self.cfg.compiled_selection):
            # Nothing drafts over this cache, and what compiles for its shapes would compile
            # again for the real cache's (tens of seconds each on a GPU).
            logger.info("TriForce: built over vLLM's minimal KV cache for its CUDA-graph "
                        "memory profile (%d blocks); compiled_sampling and "
                        "compiled_selection compile with the real cache",
                        kv_cache_config.num_blocks)
        else:
            if self.cfg.compiled_sampling:
                self._compile_sampling()
            if self.cfg.compiled_selection:
                self._compile_scoring()
                self._build_selection_graphs()
        if not self.cfg.compiled_selection:
            logger.info("TriForce block scores: eager reads of the summaries, in chunks "
                        "(compiled_selection off)")
        logger.info(engine_settings.describe(self.vllm_config, backend, self.forced_settings))
        logger.info("TriForce block summaries: %.1f MiB for %d blocks (%s); probability buffers "
                    "%.1f MiB for %d drafting requests; reads of at most %.1f MiB",
                    self.summaries.nbytes() / 2**20, kv_cache_config.num_blocks,
                    "coded in one byte a value" if self.summaries.coded else self.summaries.dtype,
                    self._probs_buffer.nbytes / 2**20,
                    self.sizing.drafting, self.sizing.chunk_bytes / 2**20)

    def _kv_groups(self, kv_cache_config, target_groups: list) -> tuple:
        """(the KV-cache group of the layers TriForce selects blocks for, the target's
        local layers by group: `WindowLayers`, or None without any). Refuses
        groups TriForce cannot run over: its layers in more than one, another group
        holding a layer that is not local, or local layers sharing its
        group (vLLM's hybrid KV-cache manager off) on a backend whose metadata builders
        keep state (one builder would serve both)."""
        groups = kv_cache_config.kv_cache_groups
        gid_of = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
        own = {gid_of[name] for name in self.target_layer_names}
        windowed = set(self.window_layer_names)
        strays = [name for gid, group in enumerate(groups) if gid not in own
                  for name in group.layer_names if name not in windowed]
        if len(own) != 1 or strays:
            raise TriForceConfigError(
                "TriForce selects blocks in one KV-cache group (its layers with full "
                "attention, beside which only local layers may have groups of "
                f"their own); vLLM made {len(groups)} groups for this model "
                f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}). "
                "Please report this with your model.")
        table_gid = own.pop()
        if not self.window_layer_names:
            return table_gid, None
        names: dict[int, list[str]] = {}
        for name in self.window_layer_names:
            names.setdefault(gid_of[name], []).append(name)
        backend = target_groups[0].backend.get_name()
        if table_gid in names and metadata_path(backend) == BUILDER_PER_LAYER:
            raise TriForceConfigError(
                f"TriForce on {backend} runs local layers beside full-attention "
                "ones only in KV-cache groups of their own; vLLM's hybrid KV-cache manager "
                "is off here, which puts them in one group. Fix: leave "
                "--disable-hybrid-kv-cache-manager unset (and use a KV connector that "
                "supports it), or choose FLASH_ATTN or TRITON_ATTN with --attention-backend.")
        windows = WindowLayers(names, {gid: groups[gid].kv_cache_spec.block_size
                                       for gid in names})
        logger.info("TriForce selects blocks for %d of the target's %d layers (full "
                    "attention, KV-cache group %d); its local layers (sliding-window or "
                    "chunked) run over their own window in every pass (KV-cache groups %s)",
                    len(self.target_layer_names),
                    len(self.target_layer_names) + len(self.window_layer_names), table_gid,
                    ", ".join(map(str, sorted(names))))
        return table_gid, windows

    def _compile_scoring(self) -> None:
        """`compiled_selection`: the policy's block scores of each step's selection as one
        compiled kernel over these summaries, and the middle rounds' shortlist re-ranking,
        query to selection, as one compiled graph (core/fused_reads.py); with round graphs,
        each middle pass's tables and slots as one compiled function
        (engine/device/round_graph.PassLayout); all compiled now. A read chunk of lazy
        summaries from the KV cache is one compiled function over every layer's cache
        (engine/summary_keeper.BlockReads), compiled once that cache exists
        (`_compile_after_binding`). A compilation that fails leaves that part eager, with a
        warning."""
        try:
            compiled = CompiledScores(self.summaries, self.policy.variance, self.shape.blocks,
                                      self.shape.num_q_heads, self.policy.scale,
                                      self.retrieval.selector.shortlist_size)
            seconds = compiled.warm_up()
        except Exception as exc:  # noqa: BLE001 - inductor's failures are many kinds
            logger.warning("TriForce compiled_selection: compiling the block scoring failed "
                           "(%s: %s); it reads the summaries eagerly, in chunks.",
                           type(exc).__name__, first_line(exc))
        else:
            self.policy.compiled = compiled
            if compiled.table_failed is not None:
                logger.warning("TriForce compiled_selection: compiling a step's whole "
                               "selection failed (%s); its block scores are one compiled "
                               "kernel and it ranks them eagerly; a middle round's "
                               "re-ranking is one compiled graph (compiled in %.1f s).",
                               compiled.table_failed, seconds)
            else:
                logger.info("TriForce compiled_selection: a step's selection and shortlist "
                            "are one compiled graph, a middle round's re-ranking another "
                            "(compiled in %.1f s)", seconds)
        # the lazy summaries' read: once vLLM has bound its cache (`_compile_after_binding`)
        self.retrieval.keeper.block_reads.wanted = self.retrieval.keeper.may_be_lazy()
        graphs = self.retrieval.round_graphs
        if graphs is None:
            return
        layout = graphs.buffers.layout
        try:
            seconds = layout.compile(self.shape.num_layers, self.shape.blocks.max_selected,
                                     self.device)
        except Exception as exc:  # noqa: BLE001 - inductor's failures are many kinds
            logger.warning("TriForce compiled_selection: compiling the middle passes' layout "
                           "failed (%s: %s); it stays eager.", type(exc).__name__,
                           first_line(exc))
            return
        logger.info("TriForce compiled_selection: a middle pass's tables and slots are one "
                    "compiled function (compiled in %.1f s)", seconds)

    def _compile_sampling(self) -> None:
        """`compiled_sampling`: a sampled draft step's and middle round's vocabulary work as
        one compiled call a chunk (core/compiled_sampling.py), compiled now, for the target's
        dtype; a compilation that fails leaves it eager, with a warning."""
        sampling = CompiledSampling(self.vllm_config.model_config.dtype)
        try:
            seconds = sampling.warm_up(self.shape.vocab_size, self.device)
        except Exception as exc:  # noqa: BLE001 - inductor's failures are many kinds
            logger.warning("TriForce compiled_sampling: compiling the sampled rounds' "
                           "vocabulary work failed (%s: %s); it stays eager.",
                           type(exc).__name__, first_line(exc))
            return
        self.middle.sampling = sampling
        if self.draft is not None:
            self.draft.sampling = sampling
        logger.info("TriForce compiled_sampling: a sampled draft step's distributions and "
                    "draws, and a middle round's verification, are one compiled call a chunk "
                    "(compiled in %.1f s)", seconds)

    def _build_selection_graphs(self) -> None:
        """`selection_graphs`: a middle round's re-selection and the next pass's load as
        one graph per bucket over the round graphs' buffers (engine/device/
        selection_graph.py); the start-up log says whether, and why not."""
        if not self.cfg.selection_graphs:
            return
        retrieval = self.retrieval
        graphs, compiled = retrieval.round_graphs, self.policy.compiled
        why = ("the middle passes are built per pass" if graphs is None
               else "the re-ranking is not compiled" if compiled is None
               else "the selector keeps no shortlist" if retrieval.selector.shortlist_size == 0
               # banded variance shares are made again after a fold: a graph would keep
               # the old ones (compiled_selection refuses banded variances anyway)
               else "the key variance is banded" if self.summaries.channel_profile is not None
               # a graph would write TriForce's tables and slots, not the local layers'
               else "the target has local layers" if graphs.windows
               else None)
        if why is not None:
            logger.warning("TriForce selection_graphs: off (%s); rounds re-select the "
                           "per-call way.", why)
            return
        retrieval.selection_graphs = SelectionGraphs(
            graphs, compiled, retrieval.num_heads, retrieval.head_size,
            retrieval.selector.shortlist_size, self.shape.max_blocks, self.device,
            graphs.use_cuda_graphs)
        logger.info("TriForce selection_graphs: a middle round's re-selection and the next "
                    "pass's load are one %s per bucket; buffers %.1f MiB",
                    "CUDA graph" if graphs.use_cuda_graphs else "run over the buffers",
                    retrieval.selection_graphs.nbytes / 2**20)

    def _compile_after_binding(self) -> None:
        """`compiled_selection`'s read of lazy summaries from the KV cache, compiled once
        vLLM has bound the cache to the layers (after `_build_drafting`): the host calls this
        from its warm-up (V1: `dummy_run`, MRV2: `initialize_kv_cache`); where none runs
        after the binding, the keeper compiles it at the first commit."""
        if self.retrieval is not None and not self.sizing_kv_cache:
            keeper = self.retrieval.keeper
            keeper.block_reads.compile_when_bound(keeper.reader, "at start-up")

    def _build_levels(self, paged_keys, unreadable: str | None, target_groups: list) -> None:
        """Each level gets exactly what it uses, from the engine's shape. `paged_keys`:
        engine/paged_keys.py's reader of this KV cache (None: `unreadable` says why)."""
        shape = self.shape
        layer = self.target_layers[0]
        selector = Selector(self.policy, shape.blocks, self.cfg.middle_shortlist, keys=paged_keys,
                            chunk_requests=shape.selection_chunk_requests)
        keeper = SummaryKeeper(self.summaries, self.layer_capture, selector, self.stats,
                               self.device, unreadable=unreadable)
        from_cache = self.cfg.prefill_from_cache_on(torch.device(self.device).type)
        if from_cache and keeper.may_be_lazy():
            # a long prefill's blocks come from the cache, not its keys (config.py)
            self.layer_capture.compact_large_passes(shape.gamma2 + 1, keeper.fold_tokens(),
                                                    when=keeper.may_be_lazy)
            logger.info("TriForce prefills: a pass of more than %d tokens keeps each request's "
                        "last %d query rows; its prompts' summaries are read back from the KV "
                        "cache (prefill_from_cache)", self.layer_capture.copy_tokens,
                        shape.gamma2 + 1)
        elif from_cache:  # asked for (a warning), or on by default with a CUDA device
            log = logger.warning if self.cfg.prefill_from_cache else logger.info
            log("TriForce prefills: prefill_from_cache has no effect here, summaries are "
                "folded from every key, a long prompt chunk's held until then (%s)",
                unreadable or "the policy or the KV cache's dtype needs them")
        else:
            logger.info("TriForce prefills: folded from their keys as computed, a long prompt "
                        "chunk's held until then (prefill_from_cache off)")
        self.retrieval = RetrievalLevel(
            self.target_model, self.vllm_config, target_groups, self.target_layer_names,
            layer.num_heads, layer.head_size, self.layer_capture, keeper, selector,
            self.refresh, self.stats, self.device, pass_limits=shape.pass_limits,
            round_graphs=self._round_graphs("middle", self.target_model,
                                            self.target_layer_names, target_groups),
            windows=self.windows, adapters=self._pass_adapters())
        self.draft = None
        if self.shape.has_draft:
            model, groups, names = self._draft_parts()
            self.draft = DraftLevel(model, self.vllm_config, groups, self._draft_window(),
                                    self.stats, self.generator, self.device,
                                    round_graphs=self._round_graphs("draft", model,
                                                                    sorted(names), groups))
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        self.depth = DepthChooser(shape.gamma2, shape.has_draft, self.stats,
                                  fixed_depth=None if self.cfg.adaptive else shape.gamma2,
                                  share=_from_tp_rank0 if tp > 1 else None, blocks=shape.blocks,
                                  max_drafting=self.sizing.drafting)
        self.middle = MiddleLoop(self.draft, shape.gamma1, self.refresh, self.stats,
                                 self.generator, self.cfg.measure_middle_acceptance)
        self.plain_steps = PlainSteps(shape.blocks, keeper, self.depth, self.stats)

    def _round_graphs(self, level: str, model, layer_names, groups) -> RoundGraphs | None:
        """A level's passes over persistent buffers (`round_graphs`: engine/device/
        round_graph.py): "middle", the target's layers `layer_names` over a table per layer,
        or "draft", the small draft's over one table. None: off, or this backend builds
        metadata per layer; the start-up log says which path the level takes, and why."""
        if not self.cfg.round_graphs:
            logger.info("TriForce %s passes: built per pass (round_graphs off)", level)
            return None
        shape, names = self.shape, set(layer_names)
        groups_of_target, groups = groups, [g for g in groups if set(g.layer_names) & names]
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        path, why = RoundGraphs.path(groups[0].backend.get_name(), self.device, tp,
                                     groups[0].kernel_block_size)
        if len(groups) != 1:
            path, why = "per pass", f"{level} layers in {len(groups)} attention groups"
        if takes_mrope(model):
            path, why = "per pass", "the model rotates with M-RoPE: its buffers hold 1-D positions"
        windows = ()
        if level == "middle" and self.windows is not None:
            windows, local_why = self._round_windows(groups_of_target)
            if windows is None:
                path, why = "per pass", local_why
        if level == "middle" and self.vllm_config.lora_config is not None:
            path, why = "per pass", "LoRA adapters are mapped to each pass's tokens"
        if path == "per pass":
            logger.info("TriForce %s passes: built per pass (%s)", level, why)
            return None
        draft = level == "draft"
        # what the memory plan reserved
        bounds = (shape.draft_round_bounds if draft else shape.round_bounds)(self.sizing.drafting)
        self.layer_capture.use_step_buffers()  # vLLM's passes into buffers too, not clones
        graphs = RoundGraphs(model, self.vllm_config, groups[0], list(layer_names), bounds,
                             None if draft else self.layer_capture, self.device,
                             use_cuda_graphs=path == "cuda graphs", shared_table=draft,
                             sample_last=draft, windows=windows)
        graphs.planned_bytes = self.sizing.round_bytes
        logger.info("TriForce %s passes: %s (%s), %d token buckets up to %d tokens x %d "
                    "requests x %d blocks%s; input buffers %.1f MiB", level, path, why,
                    len(bounds.buckets), bounds.max_tokens, bounds.max_requests,
                    bounds.max_width,
                    f", sliding-window layers in {len(windows)} KV-cache group(s) beside"
                    if windows else "", graphs.buffers.nbytes / 2**20)
        if level == "middle" and os.environ.get(LAUNCH_AHEAD_ENV) == "1":
            logger.info("TriForce middle passes: each round's next pass launched before the "
                        "host waits for the round's tokens (%s=1, experimental)",
                        LAUNCH_AHEAD_ENV)
        return graphs

    def _round_windows(self, groups) -> tuple:
        """(the target's local layers as the middle level's buffers serve them: a
        `WindowGroup` per KV-cache group, None) or (None, why they cannot), `groups`
        being the target's attention groups. Chunked layers (Llama 4) cannot: vLLM's
        builder splits each request into chunks as it builds, a shape per pass."""
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        max_model_len = self.vllm_config.model_config.max_model_len
        windows = []
        for gid, names in sorted(self.windows.names.items()):
            if any(getattr(layers[n], "attention_chunk_size", None) for n in names):
                return None, ("chunked local layers: vLLM's builder splits each request "
                              "into chunks as it builds")
            owners = [g for g in groups if set(g.layer_names) & set(names)]
            if len(owners) != 1:
                return None, (f"the local layers of KV-cache group {gid} in {len(owners)} "
                              "attention groups")
            block_size = self.windows.block_sizes[gid]
            windows.append(WindowGroup(gid, tuple(names), owners[0], block_size,
                                       -(-max_model_len // block_size) + 1))
        return tuple(windows), None

    def _draft_window(self):
        hf = self.vllm_config.speculative_config.draft_model_config.hf_config
        return draft_window(self.shape, hf.max_position_embeddings)

    # ---- memory -----------------------------------------------------------------------
    def memory_plan(self) -> MemoryPlan:
        """What this engine will allocate beside the KV cache (engine/memory.py): the
        engine shape's plan (the one the CPU KV sizing makes, patches/cpu_defaults.py), with
        this runner's KV bytes per block and attention backend."""
        return self.shape.memory_plan(kv_bytes_per_block(self.vllm_config,
                                                         self._kv_cache_specs()),
                                      self.target_layers[0].attn_backend.get_name())

    def reserve_memory(self, available: int) -> int:
        """Called with the bytes vLLM would turn into KV blocks; returns the smaller budget
        that leaves room for this engine's own buffers (patches/kv_reservation.py), sized
        for the blocks that budget makes (`self.sizing`). Refuses, with the reservation's
        parts and the fix, a budget that then holds no max_model_len request."""
        plan = self.memory_plan()
        num_blocks = plan.blocks_for(available)
        specs = self._kv_cache_specs().values()
        check_one_request(plan, available, num_blocks,
                          needed=sum(s.max_memory_usage_bytes(self.vllm_config) for s in specs),
                          max_model_len=self.vllm_config.model_config.max_model_len)
        self.sizing = plan.sized(num_blocks)
        self.reserved_bytes = available - num_blocks * plan.kv_bytes_per_block
        logger.info("TriForce: %s", describe_reservation(plan, available, num_blocks))
        return num_blocks * plan.kv_bytes_per_block

    def _agreed_sizing(self, num_blocks: int) -> Sizing:
        """The sizing `reserve_memory` reserved for (or, where vLLM sized the cache without
        asking, the one for the `num_blocks` it made), with the smallest drafting cap of the
        TP ranks, so that every rank drafts for the same requests (the middle passes'
        collectives match) and none for more than it reserved rows for."""
        sizing = self.sizing or self.memory_plan().sized(num_blocks)
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            sizing = dataclasses.replace(sizing, drafting=_tp_min(sizing.drafting))
        return sizing

    # ---- a setting -----------------------------------------------------------------
    def set_fixed_depth(self, depth: int | None) -> None:
        """Fixed-gamma TriForce from the next step on: every decoding request drafts
        `depth` tokens a step (at most the step's bound from vLLM; 0 past the drafting cap
        or where its sampling needs vLLM's plain sampler) with every level, whatever the
        clocks, its context length or its seed (engine/depth.py). None: back to the
        configured behaviour, the depth controller (`adaptive`, the default) or
        num_speculative_tokens (`adaptive: false`). A per-engine override for benchmarks
        and demos, e.g. `drafter_of(llm).set_fixed_depth(4)` (vllm_triforce/offline.py);
        with tensor parallelism, set it on every rank."""
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or depth < 0):
            raise ValueError(f"set_fixed_depth({depth!r}): a depth is an integer >= 0, or None")
        self.depth.fix(depth)

    # ---- one step -------------------------------------------------------------------
    def _plain_step_done(self, start: float) -> None:
        """A step the host found nothing to do in (engine/plain_steps.py): what it still
        owes, without a device read."""
        self.layer_capture.clear()
        if len(self.states):  # states of requests that left go now, not at a later step
            self._release(self.states.retain(self._live_requests()))
        self.stats.add(middle_seconds=time.perf_counter() - start)
        self._publish_stats()

    def _run_step(self, batch: StepBatch, start: float, max_depth: int):
        """One step after vLLM's pass, from its `batch`: commit, plan, select, middle loop,
        hand-off. Returns one draft list per request, the drafting requests' probs
        [D, max depth, V] and their request ids (None, None when every drafting request
        is greedy or none drafts). `max_depth`: this step's bound from vLLM."""
        live = self._live_requests()
        batch.never_drafts = self.plain_steps.never(batch.req_ids, live)
        self._last_batch = batch
        states, dropped = self.states.of_batch(batch.req_ids, live, self._new_state)
        self._release(dropped)
        try:
            with self.layer_capture.paused():  # what it holds is vLLM's pass, read below
                if self.draft is not None:
                    self.draft.invalidate(batch, states)
                with self.retrieval.begin_step(batch, states,
                                               judged_alone=self.draft is None) as step:
                    depth = self._begin_depth(step, start)
                    drafts, probs, prob_req_ids = self._step(step, depth, max_depth)
        finally:
            self.layer_capture.clear()  # vLLM's next pass records afresh
        self._handed_last = any(drafts)
        depth.end(drafting=self._handed_last, one_time=step.summarise_seconds)
        self.stats.add(middle_seconds=time.perf_counter() - start)
        self._publish_stats()
        return drafts, probs, prob_req_ids

    def _release(self, dropped: list) -> None:
        """The rows of requests whose states were dropped, free for new requests."""
        if dropped:
            rows = [st.refresh for st in dropped]
            self.retrieval.selections.release(rows)
            self.refresh.release(rows)

    def _begin_depth(self, step, start: float):
        """The step's engine/depth.DepthStep, from what vLLM's pass measured (the commit,
        `step`, counted it)."""
        batch = step.batch
        num_tokens = sum(batch.q_lens)
        return self.depth.begin(start, batch.req_ids, num_tokens=num_tokens,
                                emitted=num_tokens - sum(batch.num_rejected),
                                pure_decode=all(batch.decoding) and not step.prefills,
                                verified=step.verified,
                                live_req_ids=self._live_requests())

    def _step(self, step, depth, max_depth: int):
        """plan -> select -> middle loop -> hand-off, in the retrieval level's `step` and
        the depth chooser's `depth` (see `_run_step`)."""
        batch = step.batch
        rows = batch.decoding_rows()

        depths, use_draft = depth.plan(of_rows(batch.req_ids, rows), max_depth,
                                       num_committed=of_rows(batch.committed, rows),
                                       seeded=of_rows(batch.seeded, rows),
                                       plain=of_rows(batch.plain, rows))
        depths_array = np.asarray(depths, dtype=np.int64)
        drafting = np.asarray(rows, dtype=np.int64)[depths_array > 0]
        if not drafting.size:
            return [[] for _ in range(batch.num_reqs)], None, None
        step.select(drafting, middle_tokens=depths_array[depths_array > 0])
        drafts_by_row = self.middle.run(step, rows, depths, self._probs_buffer,
                                        use_draft and self.draft is not None,
                                        on_round=depth.round_done)
        step.record_handed(drafts_by_row.rows, depths)
        return hand_off(batch, drafts_by_row, depths, self._probs_buffer)

    def _publish_stats(self) -> None:
        """Log and export the counters from TP rank 0 (every rank holds the same ones)."""
        if self.vllm_config.parallel_config.rank != 0:
            return
        self.stats.live_requests = len(self.states)
        self.stats.maybe_log()
        # at once when a request came or went; else at most every PUBLISH_INTERVAL_S
        self._metrics.publish(at_once=self.stats.live_requests != self._published_live)
        self._published_live = self.stats.live_requests

    def _new_state(self, req_id: str) -> RequestState:
        state = RequestState(refresh=self.refresh.new_state(), policy_state=SelectionState())
        request = self._live_requests().get(req_id)
        seed = getattr(getattr(request, "sampling_params", None), "seed", None)
        if seed is not None:  # seeded requests: reproducible, independent of the batch
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed((seed * 1_000_003 + 0x7F4A7C15) % 2**63)
        return state


def host_of(runner) -> Drafting | None:
    """The TriForce engine a model runner holds: the V1 runner's `drafter` (a
    TriForceProposer) or Model Runner V2's `speculator` (a TriForceSpeculator, under
    `VLLM_TRIFORCE_MRV2=1`); None for a runner without one (plain vLLM, another drafter)."""
    for name in ("drafter", "speculator"):
        host = getattr(runner, name, None)
        if isinstance(host, Drafting):
            return host
    return None


def kv_bytes_per_block(vllm_config, specs: dict) -> int:
    """The bytes one KV block id takes, as vLLM sizes its cache from `specs` (layer name
    -> KV-cache spec): its largest KV-cache group's pages (vllm/v1/core/kv_cache_utils.py
    `get_kv_cache_config_from_groups`). Every layer's with one group; with sliding-window
    layers in groups of their own, the groups share each block id's bytes (Gemma 3's
    five sliding groups and one full group: a sixth of the layers' pages)."""
    get_kv_cache_groups = moved("get_kv_cache_groups")
    groups = get_kv_cache_groups(vllm_config, dict(specs))  # it may rewrite the dict
    return max(sum(specs[name].page_size_bytes for name in group.layer_names)
               for group in groups)


def _tp_min(value: int) -> int:
    """The smallest `value` of the TP ranks, on every rank (an all-reduce over vLLM's TP
    group's CPU group, vllm/distributed/parallel_state.py, 0.32.0)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    value = torch.tensor([value])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return int(value.item())


def _from_tp_rank0(obj):
    """`obj` as TP rank 0 has it, on every rank (vllm/distributed/parallel_state.py, 0.32.0)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast_object(obj, src=0)
