"""The memory TriForce allocates beside vLLM's KV cache, reserved before vLLM sizes it.

vLLM sizes the KV cache from what is free after its profile run
(`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py; `CPUWorker`'s on CPU),
which runs before the proposer allocates anything of its own. Unreserved, TriForce's
buffers would come on top of `gpu_memory_utilization` and could OOM a GPU. So the
`kv_reservation` patch asks `reserve()` to shrink the budget it hands to vLLM:

* per KV block (scales with the cache): the block summaries, one key-sized vector per
  target layer and KV head in `summary_dtype` (the KV cache's, or the model's for an
  fp8 / int8 cache) plus an int32 count (≈ KV bytes /
  (2 × block_size) for the target's layers); plus, with `key_variance` (the default for
  `retrieval`), one more such vector in float32 (the keys' square deviations); plus, for `quest`,
  two more (per-channel key min and max); plus, only with `allow_full_key_copy`, a copy of
  every committed key (h2o, topk_oracle);
* with a stateful attention backend (FLEX_ATTENTION, FLASHINFER), one metadata builder per
  target layer for the middle level's per-layer tables, made for a middle pass's limits
  (engine/forward.py `per_layer_limits`, `per_layer_builder_bytes`): FLEX's block map is
  8 B per block per drafting request and layer (Llama-3.1-8B, 32 drafting requests: 8.3 KiB
  per 2 MiB block), its index tables ~8 MB per layer at 128K;
* fixed: float32 distributions over the vocabulary, `vocabulary_rows`: per drafting
  request (at most MAX_DRAFTING_REQUESTS = 32 in a step, whatever `max_num_seqs`), the
  [gamma2, V] draft probabilities handed to vLLM (preallocated once) and a middle round's
  rows; plus the temporaries of one chunk of `sampling_probs`, whatever the batch; plus
  the block selection's scratch (`selection_scratch_bytes`: score tensors of the drafting
  requests' tables, chunked reads of the summaries or the KV cache, the queries), 0.49 GB
  for Llama-3.1-8B at 128K and 32 drafting requests, or, where larger, the fold of a
  prefill's keys into the summaries (`fold_scratch_bytes`, 0.34 GB for it), which never
  runs at the same time.

Worked example (SmolLM2-135M float32 on CPU, block 32, 30 layers × 3 KV heads × 64,
no draft, 1 GiB budget, max_num_seqs 8, gamma2 6, V 49,152, `key_variance` false): a KV
block is 30 × 2 × 32 × 3 × 64 × 4 = 1,474,560 B and its summary 30 × 3 × 64 × 4 + 4 =
23,044 B; fixed = (8 × (6 + 3 + 8) + 13 × 8) rows × 49,152 × 4 = 47,185,920 B; blocks =
(2^30 − 47,185,920) // 1,497,604 = 685, so vLLM gets 685 × 1,474,560 B and 63,668,224 B stay
reserved. With the default `key_variance` the summary is 2 × 23,040 + 4 = 46,084 B and
blocks = (2^30 − 47,185,920) // 1,520,644 = 675; with `quest` 3 × 23,040 + 4 = 69,124 B
and 665 blocks.

Worked example at scale (Llama-3.1-8B, bf16 KV cache, block 16, 32 layers × 8 KV heads ×
128, V 128,256, two levels, gamma2 6, default `key_variance`, one 80 GB GPU): a KV block is
32 × 2 × 16 × 8 × 128 × 2 = 2,097,152 B; its summary 32 × 8 × 128 × 2 (bf16 key sums) + 4 +
32 × 8 × 128 × 4 (float32 square deviations) = 196,612 B, 3/32 of the block. A 128K-token
request holds 8,192 blocks: 16 GiB of KV and 1.5 GiB of summaries. Of the ~52 GB left for
the cache after 16 GB of weights and vLLM's activations at gpu_memory_utilization 0.9,
about 22,700 blocks fit (≈ 2.8 requests of 128K). The fixed part (`vocabulary_rows`) is
17 rows of 128,256 × 4 B per drafting request (gamma2 = 6 of them the hand-off buffer)
plus one sampling chunk, for at most 32 drafting requests whatever `max_num_seqs`: 15 MB
at `--max-num-seqs 1`, 62 MB at 4 (the right setting for 128K contexts), 0.49 GB from 32
sequences up (vLLM's default 1,024 included), of which the hand-off buffer is 0.1 GB.
(Before the compact hand-off, patches/handoff_rows.py, the buffer had a row per
`max_num_seqs`: 3.5 GB at 1,024.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_triforce.core.policy_facts import SummaryKinds
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.core.verify import SAMPLING_CHUNK_ROWS
from vllm_triforce.engine.depth import MAX_DRAFTING_REQUESTS

FLOAT32_BYTES = 4
COUNT_BYTES = 4  # int32 committed-token count per block
# temporaries per row of `sampling_probs` (`vocabulary_rows`): measured 12 on an H100
# (benchmarks/explore/sampling_chunks.py: 490 MiB above the inputs for 224 rows by 64), 6 on
# a CPU (tests/test_memory_plan.py)
SAMPLING_ROWS_PER_ROW = 13


@dataclass(frozen=True)
class MemoryPlan:
    kv_bytes_per_block: int       # every layer of the KV-cache group (target and draft)
    summary_bytes_per_block: int  # TriForce's per-block state (and per-layer builders')
    fixed_bytes: int              # probability buffers (and per-layer builders' fixed part)

    @classmethod
    def for_engine(cls, kv_bytes_per_block: int, num_target_layers: int, num_kv_heads: int,
                   head_dim: int, block_size: int, kv_dtype_bytes: int, kinds: SummaryKinds,
                   max_num_seqs: int, gamma2: int, gamma1: int,
                   vocab_size: int, builders: tuple[int, int] = (0, 0),
                   max_blocks: int = 0, num_q_heads: int = 0,
                   max_batched_tokens: int = 0) -> "MemoryPlan":
        """`kinds`: the optional block state kept (TriForceConfig.summary_kinds(), which
        the proposer also allocates from). `kv_dtype_bytes`: the bytes of `summary_dtype`,
        the summaries' element (the KV cache's element unless that is fp8 or int8).
        `builders`: (bytes per block, fixed bytes) of the per-layer attention-metadata
        builders a stateful backend needs (engine/forward.py `per_layer_builder_bytes`).
        `max_blocks`: blocks of the longest request (max_model_len / block_size, rounded
        up), `num_q_heads` the target's query heads: with them the plan also holds the
        block selection's scratch (`selection_scratch_bytes`; 0: left out, as in the
        worked examples above). `max_batched_tokens`: the most tokens of one pass (vLLM's
        `max_num_batched_tokens`), for the fold's scratch (`fold_scratch_bytes`; 0: left
        out)."""
        key_bytes = num_target_layers * num_kv_heads * head_dim * kv_dtype_bytes
        summary = (key_bytes + COUNT_BYTES + (key_bytes * block_size if kinds.keep_keys else 0)
                   + (2 * key_bytes if kinds.keep_bounds else 0)
                   + (key_bytes // kv_dtype_bytes * FLOAT32_BYTES if kinds.keep_variance else 0))
        scratch = (selection_scratch_bytes(min(max_num_seqs, MAX_DRAFTING_REQUESTS),
                                           num_target_layers, max_blocks, num_kv_heads,
                                           head_dim, num_q_heads or num_kv_heads)
                   if max_blocks > 0 else 0)
        scratch = max(scratch, fold_scratch_bytes(max_batched_tokens, num_target_layers,
                                                  num_kv_heads, head_dim))
        return cls(kv_bytes_per_block, summary + builders[0],
                   vocabulary_rows(max_num_seqs, gamma2, gamma1) * vocab_size * FLOAT32_BYTES
                   + builders[1] + scratch)

    def kv_budget(self, available: int) -> int:
        """Bytes vLLM may give the KV cache so that KV + summaries + fixed fit `available`."""
        blocks = max(available - self.fixed_bytes, 0) // (
            self.kv_bytes_per_block + self.summary_bytes_per_block)
        return blocks * self.kv_bytes_per_block

    def available_for(self, kv_bytes: int) -> int:
        """The inverse of `kv_budget`: bytes to hand the sizing so that at least `kv_bytes`
        of KV cache remain after the reservation (for a KV size chosen before sizing)."""
        blocks = -(-kv_bytes // self.kv_bytes_per_block)
        return self.fixed_bytes + blocks * (self.kv_bytes_per_block + self.summary_bytes_per_block)

    @classmethod
    def from_vllm_config(cls, vllm_config, kv_bytes_per_token: int) -> "MemoryPlan | None":
        """The plan a TriForce engine will make, from its config alone (before any worker
        exists), or None for another engine. `kv_bytes_per_token`: every KV layer, one rank."""
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        from vllm_triforce.config import TriForceConfig, triforce_settings

        settings = triforce_settings(vllm_config)
        if settings is None:
            return None
        cfg = TriForceConfig.from_dict(settings)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        layers, heads = model.get_num_layers(parallel), model.get_num_kv_heads(parallel)
        head_dim = model.get_head_size()
        block_size = vllm_config.cache_config.block_size
        kv_dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, model)
        return cls.for_engine(
            kv_bytes_per_block=kv_bytes_per_token * block_size, num_target_layers=layers,
            num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
            kv_dtype_bytes=summary_dtype(kv_dtype, model.dtype).itemsize,
            kinds=cfg.summary_kinds(),
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
            gamma2=cfg.num_speculative_tokens,
            gamma1=cfg.draft_tokens_per_round if cfg.model is not None else 0,
            vocab_size=model.get_vocab_size(),
            max_blocks=-(-model.max_model_len // block_size),
            num_q_heads=model.get_num_attention_heads(parallel),
            max_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens)


def vocabulary_rows(max_num_seqs: int, gamma2: int, gamma1: int) -> int:
    """Vocabulary-wide float32 rows TriForce may hold at once beyond vLLM's own: an upper
    bound read from the code, which tests/test_memory_plan.py checks against the peak the
    torch memory profiler measures in `propose` (152K vocabulary, top-p, gamma2 6).

    Per drafting request, at most MAX_DRAFTING_REQUESTS of them in a step (engine/depth.py
    `cap_drafting`; a pass runs gamma1 + 1 tokens of one):
    * gamma2: the probabilities handed to vLLM (`hand_off`'s buffer, preallocated, one row
      per drafting request: patches/handoff_rows.py), which the middle rounds write into as
      they go (engine/middle.py);
    * 3 (gamma1 + 1): the retrieval pass's logits, their distributions, and `verify`'s
      float32 copy of them;
    * gamma1 + 2 with a small draft: its proposals' distributions, one draft step's logits
      and distribution;
    * 8: `verify`'s final distribution (target and draft rows at the first rejection, the
      residual, the choice) and its float64 cumulative sum (2 rows each, twice).
    Fixed: `sampling_probs` transforms at most SAMPLING_CHUNK_ROWS rows at once, with at most
    SAMPLING_ROWS_PER_ROW temporaries each (a float32 copy, sort values, int64 order, softmax,
    cumulative mass, the mask; on CUDA the sort's own buffers)."""
    drafting = min(max_num_seqs, MAX_DRAFTING_REQUESTS)
    per_request = gamma2 + 3 * (gamma1 + 1) + (gamma1 + 2 if gamma1 else 0) + 8
    chunk = SAMPLING_ROWS_PER_ROW * min(SAMPLING_CHUNK_ROWS, drafting * (gamma1 + 1))
    return drafting * per_request + chunk


# `selection_scratch_bytes`: score tensors [R, L, B] float32 alive at once (the dots of
# a scoring pass and their concatenation, the division by counts, the variance term's
# scores, `select_blocks`' NaN-free and masked copies; "all" strategies' [L, N, R] dots,
# N <= 2 R B), and chunked reads of SCORE_CHUNK_BYTES (the gathered rows, their float32
# copy, a product's contiguous operand): read from core/policies.py and core/selection.py,
# checked by tests/test_memory_plan.py (`test_selection_scratch_fits_its_reservation`)
SCORE_COPIES = 6
CHUNK_READS = 3


def selection_scratch_bytes(drafting: int, num_layers: int, max_blocks: int,
                            num_kv_heads: int, head_dim: int, num_q_heads: int) -> int:
    """Bytes a block selection (or a lazy read of summaries from the KV cache, which never
    runs at the same time) may hold at once beyond the summaries, for `drafting` requests
    selecting together (at most MAX_DRAFTING_REQUESTS) over tables of `max_blocks`:
    SCORE_COPIES score tensors, CHUNK_READS chunks of the summary store or the KV cache
    (each at most SCORE_CHUNK_BYTES, or the whole read where that is smaller; between
    middle rounds one of them is the shortlist's copy, `RetrievalPolicy.listed_copy`, kept
    for the step's re-rankings, which then read no store), a middle pass's stacked queries
    (at most STACKED_QUERIES_BYTES) and three float32 copies of the selecting requests'
    queries. Llama-3.1-8B at 128K (B = 8,192, L = 32, 8 x 128 KV,
    32 query heads), 32 drafting requests: 201 MB of scores + 201 MB of chunks + 84 MB of
    queries = 0.49 GB; at 4 requests 25 + 201 + 40 MB = 0.27 GB."""
    from vllm_triforce.core.policies import SCORE_CHUNK_BYTES
    from vllm_triforce.engine.retrieval_level import STACKED_QUERIES_BYTES

    scores = SCORE_COPIES * drafting * num_layers * max_blocks * FLOAT32_BYTES
    whole_read = drafting * max_blocks * num_layers * num_kv_heads * head_dim * FLOAT32_BYTES
    queries = 3 * drafting * num_layers * num_q_heads * head_dim * FLOAT32_BYTES
    return (scores + CHUNK_READS * min(SCORE_CHUNK_BYTES, whole_read) + STACKED_QUERIES_BYTES
            + queries)


# `fold_scratch_bytes`: float32-sized copies of one fold piece's keys [L, n, H, D] alive at
# once in BlockSummaries.add_committed (the stacked keys, their float32 copy, the gathered
# block means, the deviations; the runs' sums are 1 / block_size of that): read from
# core/summaries.py; tests/test_memory_plan.py (`test_fold_scratch_fits_its_reservation`)
# measures 3.3 with float32 keys, 4.5 with bf16 ones
FOLD_COPIES = 5


def fold_scratch_bytes(max_batched_tokens: int, num_layers: int, num_kv_heads: int,
                       head_dim: int) -> int:
    """Bytes folding one pass's committed keys into the block summaries may hold at once
    (engine/retrieval_level.py folds a prefill's keys by pieces whose keys of every layer
    fill at most SCORE_CHUNK_BYTES in float32, `RetrievalLevel.fold_tokens`): FOLD_COPIES
    pieces. Llama-3.1-8B (32 layers x 8 x 128: 128 KiB a token in float32), 8,192 batched
    tokens: pieces of 512 tokens, 5 x 64 MiB = 0.34 GB. A selection never runs at the same
    time: the plan reserves the larger of the two."""
    tokens = min(fold_piece_tokens(num_layers, num_kv_heads, head_dim), max_batched_tokens)
    return FOLD_COPIES * tokens * num_layers * num_kv_heads * head_dim * FLOAT32_BYTES


def fold_piece_tokens(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Tokens the engine folds at once: their keys of every layer fill at most
    SCORE_CHUNK_BYTES in float32 (at least one token)."""
    from vllm_triforce.core.policies import SCORE_CHUNK_BYTES

    return max(1, SCORE_CHUNK_BYTES // (num_layers * num_kv_heads * head_dim * FLOAT32_BYTES))


def allocate_summaries(kinds: SummaryKinds, num_layers: int, num_blocks: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype,
                       device=None) -> BlockSummaries:
    """The block summaries `MemoryPlan.for_engine(kinds=kinds, ...)` reserved room for."""
    return BlockSummaries(num_layers, num_blocks, num_kv_heads, head_dim, block_size,
                          dtype=dtype, device=device, **dataclasses.asdict(kinds))


def summary_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the block summaries are kept in: the KV cache's if it is a float of at
    least 2 bytes, else the model's. The captured keys are the model's (vLLM quantises them
    only as the attention backend writes the cache), and an fp8 cache's KV spec says
    `torch.uint8` (vLLM 0.32 `STR_DTYPE_TO_TORCH_DTYPE`, vllm/utils/torch_utils.py): summed
    in uint8 the keys wrap around and every score is noise; summed in fp8 they would lose
    all but 3 mantissa bits of a block's sum. `MemoryPlan` and the proposer's allocation
    both take their element size from here."""
    if kv_dtype.is_floating_point and kv_dtype.itemsize >= 2:
        return kv_dtype
    return model_dtype
