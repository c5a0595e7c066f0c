"""TriForceConfig: the `"method": "triforce"` keys of a speculative config, validated once.

A user writes, anywhere vLLM takes a speculative config (``LLM(speculative_config=...)``,
``vllm serve --speculative-config``)::

    {"method": "triforce", "model": DRAFT, "num_speculative_tokens": 6, "retrieval_budget": 1024}

and may add the keys below. Token counts are rounded up to whole KV blocks once the block
size is known (engine start); the checks that need the block size run then, still before
any weights load. This module imports nothing from vLLM so it can validate anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from vllm_triforce.core.policy_facts import (POLICY_FACTS, POLICY_NAMES, SummaryKinds,
                                             summary_kinds)

# The key of vLLM's `additional_config` that carries the TriForce settings to the workers.
ADDITIONAL_CONFIG_KEY = "triforce"
# additional_config key: the engine settings TriForce chose (engine_settings.decide).
FORCED_SETTINGS_KEY = "triforce_forced_settings"

POLICIES = POLICY_NAMES
# Policies that keep a copy of every committed key (exact attention mass): benchmarks only,
# refused unless the user opts in with `allow_full_key_copy` (memory: one more key cache).
# (`rerank` reads its shortlist's keys from vLLM's own KV cache: engine/paged_keys.py.)
FULL_KEY_POLICIES = tuple(name for name, f in POLICY_FACTS.items() if f.keeps_keys)

# Values a compact key variance (`compact_key_variance`, core/summaries.py) keeps per KV head
# (fewer where the head is too narrow for bands of an even number of channels:
# `variance_width`)
COMPACT_BANDS = 8

# Attention backends whose metadata TriForce builds correctly per layer
# (engine/device/forward.py says how each is handled). Anything else is refused at config time.
SUPPORTED_ATTENTION_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER",
                                "FLEX_ATTENTION")

# vLLM speculative-config keys passed through untouched to the draft model path.
PASSTHROUGH_KEYS = ("draft_tensor_parallel_size", "revision", "code_revision", "quantization",
                    "enforce_eager", "attention_backend",
                    # vLLM's Dynamic SD: a batch-size -> k table; its k caps each step's depth.
                    "num_speculative_tokens_per_batch_size")


class TriForceConfigError(ValueError):
    """Invalid TriForce speculative config; the message names the key and the fix."""


@dataclass(frozen=True)
class TriForceConfig:
    # The small draft (level 1). None: two levels, the target over its retrieval cache
    # drafts for the target over its full cache (the paper's "Retrieval w/o Hierarchy").
    model: str | None = None
    # gamma2: tokens proposed to the full-cache verification per step; with `adaptive`,
    # the most a request is handed in one step.
    num_speculative_tokens: int = 6
    # Choose each request's depth (0 .. num_speculative_tokens) and whether the small draft
    # runs, every step, from measured costs and acceptance (core/controller.py), so TriForce
    # is not slower than plain decoding where drafting does not pay. False: every level
    # and num_speculative_tokens tokens for each request that may draft (all but those
    # past the drafting cap or needing vLLM's plain sampler, engine/depth.py).
    adaptive: bool = True
    # Tokens in the retrieval cache (sinks + selected + recent), rounded to whole blocks.
    # Paper default 4096.
    retrieval_budget: int = 4096
    # gamma1: tokens the small draft proposes per middle-level round. Paper/reference: 1.
    draft_tokens_per_round: int = 1
    # StreamingLLM cache of the small draft: attention-sink tokens + recent window.
    # Reference: 16 sinks, a 256-token cache.
    draft_sink_tokens: int = 16
    draft_window_tokens: int = 240
    # Retrieval cache: always-kept first tokens (reference keeps chunk 0) and recent tokens.
    retrieval_sink_tokens: int = 16
    retrieval_recent_tokens: int = 64
    # Re-select the retrieval blocks every N tokens (0: never, the reference's build-once),
    # and when the rolling middle-level acceptance falls below the threshold.
    # Middle tokens count: 1 = at every drafting step from the newest
    # committed token's query and between middle rounds from the newest middle token's, so
    # the blocks follow the query that is about to attend; a longer interval saves
    # selections and attends with older ones (`bench acceptance` compares intervals).
    refresh_interval: int = 1
    # Between middle rounds, re-rank only each layer's best `middle_shortlist` x (retrieved
    # blocks) candidates of the step's start instead of every candidate (0: all of them).
    # Policies with `reranks_shortlist` (core/policy_facts.py) only; the others score every
    # candidate.
    middle_shortlist: int = 4
    refresh_acceptance_threshold: float = 0.5
    selection_policy: str = "retrieval"
    # `retrieval` (and `rerank`'s first stage): score a block by its mean key plus half the
    # query-weighted per-channel variance of its keys (an estimate of log E[exp(q.k)] over the
    # block), not the mean key alone, which hides a block whose keys spread out towards the
    # query (`bench acceptance` compares the two). Costs one more key-sized vector per
    # block (square deviations): coded, a byte a value (`compact_summaries`); else float32
    # whatever the KV cache's dtype, 1/block_size of a bf16 KV cache (at block size 16 with
    # the bf16 key sums, the summaries are then 3/32 of the KV cache).
    key_variance: bool = True
    # With `key_variance`: keep the variance per band of channels (8 per KV head, each
    # holding whole RoPE rotation pairs, core/summaries.py) in the summaries' dtype instead
    # of per channel in float32: at block size 16, head size 128 and bf16 the summaries
    # are 17/512 of the KV cache instead of 3/32, and TriForce keeps at least 96% of plain
    # vLLM's KV blocks at Llama-3.1-8B's shape (engine/memory.py; 91% per channel). A score
    # weighs each band by its channels' q^2, each by its share of the band's M2 over every
    # block folded so far (the channel profile, per layer and KV head). Opt-in, and it
    # turns `compact_summaries` off (the bands are not coded): on the acceptance bench
    # (column `retrieval_var_compact`, benchmarks/HISTORY.md) within half a point of the
    # per-channel variance on Qwen2.5-Coder-0.5B at 16K tokens (budgets 512-4,096) and 0.4
    # below on SmolLM2-135M's Moby-Dick at 4K, but 2.0 below on its needle task (896
    # positions; the bands cost it, not their bf16 rounding).
    compact_key_variance: bool = False
    # Keep the block summaries in one byte per value (core/summary_coding.py): the key sums in
    # float8 e4m3 and the key variance per channel in a one-byte log code (16 steps per
    # octave), each row of a layer's, block's and KV head's channels with a float32 scale.
    # At Llama-3.1-8B's shape the summaries take 1/31 of the KV cache instead of 3/32, and
    # TriForce keeps 96% of plain vLLM's KV blocks (engine/memory.py). On the acceptance
    # bench (column `retrieval_var_fp8_log`, benchmarks/RESULTS.md) within a point of the
    # bf16 sums and float32 variances. Default (None): on where the device converts float8
    # natively (a GPU) or `compiled_selection` reads the codes in its kernels; off on a CPU
    # otherwise, where torch converts float8 one value at a time and a middle round that
    # re-ranks a shortlist larger than one read chunk decodes it every round (SmolLM2-135M,
    # 8 x 4,096 tokens: 11 ms of TriForce's own time a round coded, 6.5 float, of about 58;
    # benchmarks/HISTORY.md), for 2-3% of the KV cache. Off with `compact_key_variance`
    # (the banded variance is not coded). `compact_summaries_on`.
    compact_summaries: bool | None = None
    # h2o / topk_oracle keep a copy of every committed key (as much memory as the key
    # cache): for benchmarks. Refused unless the user opts in here.
    allow_full_key_copy: bool = False
    # Diagnostic (benchmarks): per step, one extra pass of the target over its full cache at
    # each request's first middle position, to measure the retrieval cache's per-token
    # acceptance sum_x min(p(x), q(x)) (the paper's Table 1 quantity). Costs one target
    # pass per step; outputs are unchanged.
    measure_middle_acceptance: bool = False
    # Run the middle level's passes over persistent buffers, one pass shape per token bucket
    # (engine/device/round_graph.py): captured as CUDA graphs on FLASH_ATTN and TRITON_ATTN
    # on a GPU, replayed eagerly over the same buffers elsewhere. Off until a GPU has run a
    # real model with the graphs; a pass that fits no bucket takes today's path either way.
    round_graphs: bool = False
    # The retrieval selection's host work as compiled functions (core/compiled.py): a
    # step's block scores one kernel (core/fused_reads.py: torch.compile of the gather,
    # decode, products and sums over the coded summaries), not chunked eager reads; a
    # middle round's shortlist re-ranking one graph, query to selection; with round
    # graphs, a middle pass's tables and slots one function (engine/device/round_graph.
    # PassLayout); a read chunk of lazy summaries from the KV cache one function over
    # every layer's cache (engine/summary_keeper.BlockReads). At Llama-3.1-8B's shape
    # about 25 host operations a read chunk, some 45 more a round, and about four a layer
    # a lazy read become calls, with no float32 copy of the listed summaries.
    # Needs `compact_summaries` and the "retrieval" policy; compiles at start-up (about
    # 10-20 s on a CPU; the lazy read at the first commit under enforce_eager, where no
    # warm-up runs after vLLM binds its cache). Timed on an H200 (benchmarks/gpu/
    # round_graph_2026-12-04/); off until a GPU has run a real model with it.
    compiled_selection: bool = False
    # A middle round's re-selection and the next round's load as one graph per token
    # bucket (engine/device/selection_graph.py): the round's queries gathered, each
    # request's shortlist re-ranked (compiled), the next pass's tables, slots and inputs
    # written into the round buffers, captured as one CUDA graph on a GPU and run over the
    # same buffers elsewhere; where a round emits one token a request and every request
    # re-selects from its step's shortlist (refresh_interval 1). Needs `round_graphs` and
    # `compiled_selection`. Exact on an H200 with tiny models (benchmarks/gpu/
    # round_graph_2026-12-04/); off until a GPU has run a real model with it.
    selection_graphs: bool = False
    # A sampled batch's vocabulary work as compiled functions (core/compiled_sampling.py):
    # each draft step's distributions and draws, and each middle round's distributions,
    # acceptance tests and final draws, one call a chunk instead of some 150 host
    # operations a three-level round. The uniforms are drawn as the eager path draws them
    # (a seeded request's from its own generator); greedy batches never use it. Compiles
    # at start-up (about 15 s on a CPU). Off until a GPU has timed it.
    compiled_sampling: bool = False
    # Where summaries are set from vLLM's KV cache (engine/summary_keeper.py: a backend
    # whose cache TriForce reads back exactly), a pass larger than the capture's copies (a
    # long prompt chunk) keeps only its requests' last query rows, not every layer's query
    # and key (which hold the pass's activations alive: 5.4 GB for a 16K-token chunk at
    # Llama-3.1-8B's shape, a peak vLLM's profile run never sees), and its prompts' full
    # blocks are set from the cache right after it (engine/device/capture.py
    # `compact_large_passes`). Default (None): on with a CUDA device, where vLLM sizes its
    # KV cache by a profile run that never sees the held keys (on an H200 at vLLM's default
    # gpu_memory_utilization 0.9, 1 x 128K tokens with drafting: 96.1% of plain vLLM's
    # KV blocks, within the reservation; tokens identical to plain vLLM's with FLASH_ATTN
    # bf16: benchmarks/gpu/results.md); off elsewhere (a CPU's KV cache has a fixed size,
    # VLLM_CPU_KVCACHE_SPACE, that a held prefill does not shrink). `prefill_from_cache_on`.
    prefill_from_cache: bool | None = None
    # vLLM keys passed through to the draft-model path.
    passthrough: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_int(self, "num_speculative_tokens", 1)
        _check_int(self, "retrieval_budget", 1)
        _check_int(self, "draft_tokens_per_round", 1)
        _check_int(self, "draft_sink_tokens", 0)
        _check_int(self, "draft_window_tokens", 1)
        _check_int(self, "retrieval_sink_tokens", 0)
        _check_int(self, "retrieval_recent_tokens", 0)
        _check_int(self, "refresh_interval", 0)
        _check_int(self, "middle_shortlist", 0)
        thr = self.refresh_acceptance_threshold
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0:
            raise TriForceConfigError(
                f"speculative_config['refresh_acceptance_threshold']={thr!r} must be a number "
                "in [0, 1] (0 disables acceptance-triggered refreshes).")
        if not isinstance(self.adaptive, bool):
            raise TriForceConfigError(
                f"speculative_config['adaptive']={self.adaptive!r} must be true (choose the "
                "depth every step) or false (always num_speculative_tokens).")
        if not isinstance(self.round_graphs, bool):
            raise TriForceConfigError(
                f"speculative_config['round_graphs']={self.round_graphs!r} must be true (the "
                "middle level's passes over persistent buffers, as CUDA graphs on a GPU) or "
                "false (each pass built anew, the default).")
        if not isinstance(self.compiled_selection, bool):
            raise TriForceConfigError(
                f"speculative_config['compiled_selection']={self.compiled_selection!r} must be "
                "true (block scores and re-ranking compiled) or false "
                "(eager chunked reads, the default).")
        if not isinstance(self.compiled_sampling, bool):
            raise TriForceConfigError(
                f"speculative_config['compiled_sampling']={self.compiled_sampling!r} must be "
                "true (a sampled round's vocabulary work compiled) or false (eager, the "
                "default).")
        if not isinstance(self.selection_graphs, bool):
            raise TriForceConfigError(
                f"speculative_config['selection_graphs']={self.selection_graphs!r} must be "
                "true (a middle round's re-selection and load as one graph) or false (the "
                "default).")
        if self.selection_graphs and not (self.round_graphs and self.compiled_selection):
            raise TriForceConfigError(
                "speculative_config['selection_graphs'] runs the compiled re-ranking over "
                "the round graphs' buffers; this config has "
                f"round_graphs={self.round_graphs!r} and "
                f"compiled_selection={self.compiled_selection!r}. Set both true, or drop "
                "'selection_graphs'.")
        if self.prefill_from_cache is not None and not isinstance(self.prefill_from_cache,
                                                                   bool):
            raise TriForceConfigError(
                f"speculative_config['prefill_from_cache']={self.prefill_from_cache!r} must be "
                "true (a long prompt chunk's summaries set from the KV cache, its keys not "
                "held), false (folded from its keys) or left out (true with a CUDA device, "
                "false on a CPU).")
        if not isinstance(self.measure_middle_acceptance, bool):
            raise TriForceConfigError(
                "speculative_config['measure_middle_acceptance']="
                f"{self.measure_middle_acceptance!r} must be true or false.")
        if self.selection_policy not in POLICIES:
            raise TriForceConfigError(
                f"speculative_config['selection_policy']={self.selection_policy!r} is not one "
                f"of {', '.join(POLICIES)}.")
        if not isinstance(self.key_variance, bool):
            raise TriForceConfigError(
                f"speculative_config['key_variance']={self.key_variance!r} must be true (mean "
                "key + key variance, the default) or false (mean key only).")
        if not isinstance(self.compact_key_variance, bool):
            raise TriForceConfigError(
                f"speculative_config['compact_key_variance']={self.compact_key_variance!r} "
                "must be true (the key variance per band of channels, in the KV cache's dtype) "
                "or false (per channel, the default).")
        if self.compact_summaries is None and self.compact_key_variance:
            object.__setattr__(self, "compact_summaries", False)
        if self.compact_summaries is not None and not isinstance(self.compact_summaries, bool):
            raise TriForceConfigError(
                f"speculative_config['compact_summaries']={self.compact_summaries!r} must be "
                "true (block summaries coded in one byte a value, the default on a GPU) or "
                "false (bf16 or float32 key sums and float32 key variances: more memory, the "
                "default on a CPU).")
        if self.compact_summaries and self.compact_key_variance:
            raise TriForceConfigError(
                "speculative_config sets both 'compact_summaries' and 'compact_key_variance': "
                "the coded summaries keep the key variance per channel, the compact variance "
                "per band. Drop 'compact_key_variance' (the coded summaries take as little "
                "memory and lose less acceptance), or set 'compact_summaries': false.")
        if self.compiled_selection and not (self.compact_summaries is not False
                                            and self.selection_policy == "retrieval"):
            raise TriForceConfigError(
                "speculative_config['compiled_selection'] reads coded summaries with the "
                "'retrieval' policy; this config has "
                f"selection_policy={self.selection_policy!r} and "
                f"compact_summaries={self.compact_summaries!r}. Drop 'compiled_selection', or "
                "use selection_policy 'retrieval' with compact_summaries true or left out.")
        if not isinstance(self.allow_full_key_copy, bool):
            raise TriForceConfigError(
                f"speculative_config['allow_full_key_copy']={self.allow_full_key_copy!r} must be "
                "true or false.")
        if self.selection_policy in FULL_KEY_POLICIES and not self.allow_full_key_copy:
            raise TriForceConfigError(
                f"speculative_config['selection_policy']={self.selection_policy!r} keeps a copy "
                "of every committed key (as much memory as the key cache, not counted when vLLM "
                "sizes the KV cache): it is meant for benchmarks. Use 'retrieval' (the default), "
                "or opt in with \"allow_full_key_copy\": true.")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise TriForceConfigError(
                "speculative_config['model'] must be the small draft model's path or name, "
                "or left out for two-level TriForce.")
        # in blocks of one token: the least any block size needs (`in_blocks` checks the
        # engine's block size)
        min_budget = BlockCounts.min_budget_blocks(self.retrieval_sink_tokens,
                                                   self.retrieval_recent_tokens)
        if self.retrieval_budget < min_budget:
            raise TriForceConfigError(
                f"speculative_config['retrieval_budget']={self.retrieval_budget} leaves no room "
                f"for retrieved blocks: it must hold retrieval_sink_tokens + "
                f"retrieval_recent_tokens = {min_budget - 2}, the growing tail block and one "
                "retrieved block. Raise retrieval_budget or lower those two.")

    @classmethod
    def from_speculative_config(cls, spec: dict[str, Any]) -> "TriForceConfig":
        """Parse a user's speculative-config dict whose method is "triforce"."""
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
        if spec.pop("method", "triforce") != "triforce":
            raise TriForceConfigError("speculative_config['method'] must be 'triforce'.")
        own = {f.name for f in dataclasses.fields(cls)} - {"passthrough"}
        unknown = sorted(set(spec) - own - set(PASSTHROUGH_KEYS))
        if unknown:
            raise TriForceConfigError(
                f"speculative_config has unknown key(s) {unknown} for method 'triforce'. "
                f"Known keys: {sorted(own | set(PASSTHROUGH_KEYS) | {'method'})}.")
        passthrough = {k: spec.pop(k) for k in PASSTHROUGH_KEYS if k in spec}
        return cls(**spec, passthrough=passthrough)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `core.policies.make_policy(selection_policy, ...)`."""
        if POLICY_FACTS[self.selection_policy].takes_key_variance:
            return {"variance": self.key_variance}
        return {}

    def summary_kinds(self, device_type: str | None = None) -> SummaryKinds:
        """The block state the policy reads on a device of `device_type` ("cuda", "cpu",
        ...; None: a GPU's): what the memory plan reserves and the proposer allocates
        (`BlockSummaries(**dataclasses.asdict(kinds))`)."""
        return summary_kinds(self.selection_policy, self.key_variance,
                             self.compact_key_variance, self.compact_summaries_on(device_type))

    def compact_summaries_on(self, device_type: str | None = None) -> bool:
        """`compact_summaries` as set; left out, coded except on a CPU without
        `compiled_selection` (the field's comment says why); None: a GPU's."""
        if self.compact_summaries is not None:
            return self.compact_summaries
        return device_type != "cpu" or self.compiled_selection

    def prefill_from_cache_on(self, device_type: str) -> bool:
        """`prefill_from_cache` as set; left out, whether the device (its type: "cuda",
        "cpu", ...) is a CUDA device (the field's comment says why)."""
        if self.prefill_from_cache is not None:
            return self.prefill_from_cache
        return device_type == "cuda"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TriForceConfig":
        return cls(**d)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "TriForceConfig":
        """The config patches/spec_config.py carried to the workers in `additional_config`."""
        settings = triforce_settings(vllm_config)
        if settings is None:
            raise TriForceConfigError(
                f"vllm_config.additional_config has no {ADDITIONAL_CONFIG_KEY!r} entry: the engine "
                "was not configured with \"method\": \"triforce\".")
        return cls.from_dict(settings)

    # ---- block-size dependent view, checked at engine start ---------------------------
    def in_blocks(self, block_size: int) -> "BlockCounts":
        return BlockCounts.from_config(self, block_size)


@dataclass(frozen=True)
class BlockCounts:
    """Token counts of a TriForceConfig rounded up to whole KV blocks: the one geometry
    that selection (core/selection.py, core/blocks.py), the levels and the benchmarks pass
    around, and its bounds. The budget holds the sinks, the retrieved blocks, the recent
    blocks and the growing tail block (`num_retrieved`); a selection keeps the sinks and at
    most `max_chosen` candidates, `max_selected` blocks in all. The draft's two counts
    matter to the small draft only; a selection-only user (a benchmark, a test) may leave
    them at their defaults.

    Worked example, budget 8 blocks, 1 sink block, 2 recent blocks: num_retrieved = 8 - 1
    - 2 - 1 = 4; a request of 8 full blocks fits the budget and keeps its every candidate,
    blocks 1 to 5, so max_chosen = 5 and max_selected = 1 + 5 = 6 = 8 - 2."""
    block_size: int
    budget_blocks: int
    retrieval_sink_blocks: int
    retrieval_recent_blocks: int
    draft_sink_blocks: int = 0
    draft_window_blocks: int = 1

    def __post_init__(self) -> None:
        need = self.min_budget_blocks(self.retrieval_sink_blocks, self.retrieval_recent_blocks)
        if min(self.retrieval_sink_blocks, self.retrieval_recent_blocks) < 0 \
                or self.budget_blocks < need:
            raise TriForceConfigError(
                f"budget_blocks={self.budget_blocks} must be at least retrieval_sink_blocks "
                f"({self.retrieval_sink_blocks}) + retrieval_recent_blocks "
                f"({self.retrieval_recent_blocks}) + 2 (the growing tail block and one "
                "retrieved block), and neither count negative.")

    @staticmethod
    def min_budget_blocks(retrieval_sink_blocks: int, retrieval_recent_blocks: int) -> int:
        """The smallest budget: the sinks, the recent blocks, the growing tail block and
        one retrieved block."""
        return retrieval_sink_blocks + retrieval_recent_blocks + 2

    @property
    def num_retrieved(self) -> int:
        """Blocks a selection retrieves besides sinks, recent blocks and the growing tail
        block: budget = sinks + retrieved + recent + 1."""
        return (self.budget_blocks - self.retrieval_sink_blocks
                - self.retrieval_recent_blocks - 1)

    @property
    def max_chosen(self) -> int:
        """The most candidates a selection keeps: num_retrieved + 1, every candidate of a
        request of budget_blocks full blocks (it fits the budget, and no partial block
        takes a place in its tail)."""
        return self.num_retrieved + 1

    @property
    def max_selected(self) -> int:
        """The most blocks of a selection, sinks and chosen candidates:
        budget_blocks - retrieval_recent_blocks."""
        return self.retrieval_sink_blocks + self.max_chosen

    @classmethod
    def from_config(cls, cfg: TriForceConfig, block_size: int) -> "BlockCounts":
        up = lambda n: math.ceil(n / block_size)  # noqa: E731
        budget_blocks = max(cfg.retrieval_budget // block_size, 1)
        sinks, recent = up(cfg.retrieval_sink_tokens), up(cfg.retrieval_recent_tokens)
        need = cls.min_budget_blocks(sinks, recent)
        if budget_blocks < need:
            raise TriForceConfigError(
                f"speculative_config['retrieval_budget']={cfg.retrieval_budget} is "
                f"{budget_blocks} block(s) of {block_size} tokens; with "
                f"retrieval_sink_tokens and retrieval_recent_tokens rounded to blocks it must be "
                f"at least {need * block_size} tokens ({need} blocks: sinks {sinks} + recent "
                f"{recent} + the growing tail block + one retrieved block). Raise "
                "retrieval_budget.")
        return cls(block_size=block_size, budget_blocks=budget_blocks,
                   retrieval_sink_blocks=sinks, retrieval_recent_blocks=recent,
                   draft_sink_blocks=up(cfg.draft_sink_tokens),
                   draft_window_blocks=max(up(cfg.draft_window_tokens), 1))


def triforce_settings(vllm_config) -> dict[str, Any] | None:
    """The TriForce settings dict in a vLLM config's `additional_config`, or None."""
    return (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)


def forced_settings(vllm_config) -> list:
    """The engine settings TriForce chose for this engine (engine_settings.decide), as
    carried in `additional_config`; [] for an engine it did not configure."""
    return (vllm_config.additional_config or {}).get(FORCED_SETTINGS_KEY, [])


def with_settings(additional_config: dict | None, cfg: "TriForceConfig", forced: list) -> dict:
    """`additional_config` with the TriForce settings and the forced engine settings added
    (patches/spec_config.py carries them to the workers this way)."""
    return {**(additional_config or {}), ADDITIONAL_CONFIG_KEY: cfg.to_dict(),
            FORCED_SETTINGS_KEY: forced}


def _check_int(cfg: TriForceConfig, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TriForceConfigError(
            f"speculative_config['{name}']={value!r} must be an integer >= {minimum}.")
