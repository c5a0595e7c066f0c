"""The engine's shape: every size a TriForce engine is built to, worked out once from its config.

A TriForce engine's sizes follow from its vLLM config alone: the speculative-config keys in
whole KV blocks (`BlockCounts`), gamma2 (drafts handed to vLLM per step), gamma1 (tokens
the small draft proposes per middle round, 0 without one), the drafting cap before memory
bounds it (vLLM's max_num_seqs: every decoding request may draft), the limits of one
middle pass through per-layer attention builders, and the target's geometry that
TriForce's buffers are sized by. `EngineShape.of` reads them from the config and
`EngineShape.from_sizes` builds the shape from them (as the tests build one); the
proposer builds one at start and hands each level what it uses, and its memory plan
(engine/memory.py) comes from `memory_plan` — as does the CPU KV sizing before any worker
exists (patches/cpu_defaults.py), so the two agree by construction.

Depends on vLLM 0.32.0: `ModelConfig.get_num_layers / get_num_kv_heads /
get_num_attention_heads / get_head_size / get_vocab_size` (vllm/config/model.py) and the
metadata builders sized in `one_builder_bytes` (vllm/v1/attention/backends/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_triforce.config import BlockCounts, TriForceConfig, triforce_settings
from vllm_triforce.core.policy_facts import SummaryKinds
from vllm_triforce.core.selection import selection_chunk_requests
from vllm_triforce.engine.device.bounds import GRAPH_BACKENDS, RoundBounds
from vllm_triforce.engine.device.capture import DEFAULT_COPY_TOKENS
from vllm_triforce.engine.memory import MemoryPlan, summary_dtype
from vllm_triforce.engine_settings import full_attention_layers

# FlashInfer's prefill and decode wrappers each keep an 8 MiB int workspace of their own
# (the float workspace is shared, engine/device/forward.py `_share_workspace`); an allowance read
# from FlashInfer's wrapper constructors, not measured here (no GPU in CI).
FLASHINFER_WRAPPER_BYTES = 2 * 8 * 2**20
# A middle pass through per-layer builders (FLEX_ATTENTION, FLASHINFER) holds at most this
# many requests (engine/device/forward.py `run_pass` splits a larger one): those builders keep
# buffers per request and KV block in every layer (`per_layer_builder_bytes`), which would
# otherwise grow with the drafting cap. Stateless builders run a middle pass whole.
BUILDER_PASS_REQUESTS = 32


@dataclass(frozen=True)
class PassLimits:
    """The most requests and tokens of one pass through per-layer builders: at most
    BUILDER_PASS_REQUESTS requests of at most gamma1 + 1 tokens each (engine/device/forward.py
    `run_pass` splits any larger pass: a middle round of more drafting requests, the
    acceptance teacher's).
    The per-layer builders are made for these limits, not the runner's max_num_seqs and
    max_num_batched_tokens, which size their persistent buffers: FLEX_ATTENTION's for
    Llama-3.1-8B at 128K, 1,024 sequences and 8,192 batched tokens would hold ~0.7 GB per
    layer, ~23 GB for the 32 layers; at these limits ~12 MB per layer."""
    requests: int
    tokens: int


def pass_limits(max_num_seqs: int, max_batched_tokens: int, gamma1: int) -> PassLimits:
    """A middle pass's limits through per-layer builders in an engine of vLLM's
    `max_num_seqs` and `max_num_batched_tokens`: at most BUILDER_PASS_REQUESTS requests of
    gamma1 + 1 tokens each."""
    requests = min(max_num_seqs, BUILDER_PASS_REQUESTS)
    return PassLimits(requests, min(max_batched_tokens, requests * (gamma1 + 1)))


@dataclass(frozen=True)
class EngineShape:
    cfg: TriForceConfig
    blocks: BlockCounts      # the speculative-config keys in whole KV blocks
    kinds: SummaryKinds      # the optional block state kept (cfg.summary_kinds())
    gamma2: int              # drafts handed to vLLM per step (num_speculative_tokens)
    gamma1: int              # tokens the small draft proposes per round (0 without one)
    max_num_seqs: int        # vLLM's: the drafting cap before memory bounds it
    pass_limits: PassLimits
    max_model_len: int
    max_batched_tokens: int  # vLLM's max_num_batched_tokens
    num_layers: int          # the target's with full attention (blocks selected), one rank
    num_kv_heads: int        # per rank
    num_q_heads: int         # per rank
    head_dim: int
    vocab_size: int
    summary_dtype: torch.dtype  # the block summaries' element (engine/memory.py)
    flex_q_block: int        # attention_config's flex_attn_q_block_size, at least 128
    # vLLM's max_cudagraph_capture_size: vLLM's passes of at most this many tokens are kept
    # as copies by the capture (engine/device/capture.py)
    capture_tokens: int = DEFAULT_COPY_TOKENS
    # the target's local layers (sliding-window or chunked) beside its full ones, one rank
    local_layers: int = 0
    # the draft probabilities go to vLLM as [drafting, gamma2, V] float32 rows (the V1
    # runner); Model Runner V2 reads the middle level's logits from its own buffer instead
    # (engine/mrv2/draft_logits.py), so its host keeps no such rows
    hands_off_probs: bool = True

    @property
    def has_draft(self) -> bool:
        return self.cfg.model is not None

    @property
    def max_drafting(self) -> int:
        """Requests that may draft in one step before memory bounds them: every one vLLM
        schedules (max_num_seqs); the memory plan lowers it to what fits its share of the
        cache (engine/memory.py `Sizing.drafting`)."""
        return self.max_num_seqs

    @property
    def selection_chunk_requests(self) -> int:
        """Requests that select blocks at once (core/selection.py), for tables of a
        max_model_len request."""
        return selection_chunk_requests(self.max_blocks)

    @property
    def window_groups(self) -> int:
        """KV-cache groups the target's local layers take at most: vLLM's hybrid manager
        groups layers of one kind in groups of as many layers as the scarcer kind has
        (Gemma 3's 52 sliding layers beside 10 full: 6 groups; gpt-oss's 18 beside 18:
        1); with it off they share TriForce's group, whose rows they still need (1)."""
        if not self.local_layers:
            return 0
        return -(-self.local_layers // max(min(self.num_layers, self.local_layers), 1))

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def max_blocks(self) -> int:
        """Blocks of a max_model_len request."""
        return -(-self.max_model_len // self.block_size)

    def round_bounds(self, drafting: int) -> RoundBounds:
        """The bounds of a middle pass over persistent buffers (`round_graphs`) when
        `drafting` requests may draft at once (engine/device/bounds.py)."""
        return RoundBounds.of(self.blocks.budget_blocks, self.block_size, self.gamma1,
                              self.gamma2, self.cfg.refresh_interval, drafting,
                              self.max_blocks, self.max_batched_tokens)

    def draft_round_bounds(self, drafting: int) -> RoundBounds:
        """The same for the small draft's passes over its StreamingLLM table."""
        blocks = self.blocks
        return RoundBounds.of_draft(blocks.draft_sink_blocks + blocks.draft_window_blocks,
                                    self.block_size, self.gamma1, self.gamma2, drafting,
                                    self.max_batched_tokens)

    @classmethod
    def of(cls, vllm_config) -> "EngineShape | None":
        """The shape of the TriForce engine `vllm_config` describes (None: not TriForce)."""
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        if triforce_settings(vllm_config) is None:
            return None
        cfg = TriForceConfig.from_vllm_config(vllm_config)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        sched = vllm_config.scheduler_config
        kv_dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, model)
        q_block = getattr(vllm_config.attention_config, "flex_attn_q_block_size", None) or 0
        layers = model.get_num_layers(parallel)
        full = full_attention_layers(model, layers)
        return cls.from_sizes(
            cfg=cfg, block_size=vllm_config.cache_config.block_size,
            max_num_seqs=sched.max_num_seqs, max_model_len=model.max_model_len,
            max_batched_tokens=sched.max_num_batched_tokens,
            num_layers=full, local_layers=layers - full,
            num_kv_heads=model.get_num_kv_heads(parallel),
            num_q_heads=model.get_num_attention_heads(parallel),
            head_dim=model.get_head_size(), vocab_size=model.get_vocab_size(),
            summary_dtype=summary_dtype(kv_dtype, model.dtype), flex_q_block=q_block,
            kinds=cfg.summary_kinds(vllm_config.device_config.device_type),
            capture_tokens=(vllm_config.compilation_config.max_cudagraph_capture_size
                            or DEFAULT_COPY_TOKENS))

    @classmethod
    def from_sizes(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                   block_size: int, max_num_seqs: int, cfg: TriForceConfig | None = None,
                   gamma1: int | None = None, max_model_len: int = 0,
                   max_batched_tokens: int = 0, num_q_heads: int | None = None,
                   summary_dtype: torch.dtype = torch.float32,
                   kinds: SummaryKinds | None = None, flex_q_block: int = 0,
                   capture_tokens: int = DEFAULT_COPY_TOKENS,
                   local_layers: int = 0) -> "EngineShape":
        """The shape from its sizes: `cfg` (None: the defaults) gives the block counts,
        gamma2 and the summary kinds (`kinds` overrides them), gamma1 its tokens per round
        with a small draft (`gamma1` overrides it); `num_q_heads` defaults to the KV heads'
        count. A max_model_len or max_batched_tokens of 0 sizes no selection or fold
        scratch (engine/memory.py's first worked example)."""
        cfg = cfg or TriForceConfig()
        if gamma1 is None:
            gamma1 = cfg.draft_tokens_per_round if cfg.model is not None else 0
        return cls(
            cfg=cfg, blocks=cfg.in_blocks(block_size), kinds=kinds or cfg.summary_kinds(),
            gamma2=cfg.num_speculative_tokens, gamma1=gamma1, max_num_seqs=max_num_seqs,
            pass_limits=pass_limits(max_num_seqs, max_batched_tokens, gamma1),
            max_model_len=max_model_len, max_batched_tokens=max_batched_tokens,
            num_layers=num_layers, num_kv_heads=num_kv_heads,
            num_q_heads=num_q_heads or num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
            summary_dtype=summary_dtype, flex_q_block=max(128, flex_q_block),
            capture_tokens=capture_tokens, local_layers=local_layers)

    def memory_plan(self, kv_bytes_per_block: int, backend: str | None) -> MemoryPlan:
        """What the engine allocates beside a KV cache of `kv_bytes_per_block` (every KV
        layer, one rank) with the attention backend named `backend` (None: stateless)."""
        return MemoryPlan.for_engine(self, kv_bytes_per_block, self.builder_bytes(backend),
                                     cuda_graphs=backend in GRAPH_BACKENDS)

    def builder_bytes(self, backend: str | None) -> tuple[int, int]:
        """(bytes per KV block, fixed bytes) of a stateful backend's per-layer builders: one
        per target layer, plus one build's transient block map (FLEX: `physical_to_logical`);
        (0, 0) for a stateless backend or None."""
        if backend is None:
            return 0, 0
        per_block, fixed = self.one_builder_bytes(backend)
        return (self.num_layers + 1) * per_block, self.num_layers * fixed

    def one_builder_bytes(self, backend: str) -> tuple[int, int]:
        """(bytes per KV block, fixed bytes) that ONE per-layer builder keeps in this engine
        (`per_layer_builder_bytes` at `pass_limits`, for a max_model_len request)."""
        return per_layer_builder_bytes(backend, self.pass_limits, self.max_blocks,
                                       self.flex_q_block)


def per_layer_builder_bytes(backend: str, limits: PassLimits, pages: int,
                            flex_q_block: int = 128) -> tuple[int, int]:
    """(bytes per KV block, fixed bytes) that ONE per-layer builder keeps when made for
    `limits` (R requests, T tokens), P = `pages` of a max_model_len request; read from vLLM
    0.32.0's builders (tests/test_flex_backend.py measures FLEX's on CPU): FLEX_ATTENTION:
    physical_to_logical [R, num_blocks] int64 (per block), kv_indices [cdiv(T, q) * q, P]
    and R-SWA kv_indices [T, P + 1] int32, and [T]- and [R]-sized int32 vectors (q =
    `flex_q_block`: attention_config's query block, at least 128); FLASHINFER: paged_kv_indices
    [R * P] int32, its indptr and last-page vectors (host and device),
    FLASHINFER_WRAPPER_BYTES. Backends whose builder keeps no state (engine/device/forward.py
    METADATA_PATHS): none."""
    from vllm_triforce.engine.device.forward import BUILDER_PER_LAYER, METADATA_PATHS

    if METADATA_PATHS.get(backend) != BUILDER_PER_LAYER:
        return 0, 0
    requests, tokens = limits.requests, limits.tokens
    if backend == "FLEX_ATTENTION":
        q_block = flex_q_block
        fixed = 4 * ((-(-tokens // q_block) * q_block) * pages + tokens * (pages + 1)
                     + -(-tokens // 16) + 3 * tokens + 4 * requests + 1)
        return 8 * requests, fixed
    return 0, 4 * (requests * pages + 2 * (2 * requests + 1)) + FLASHINFER_WRAPPER_BYTES


def requested_backend(vllm_config) -> str | None:
    """The attention backend's name the config asks for, or None (the platform's default:
    CPU_ATTN on a CPU, which keeps no builders)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))
