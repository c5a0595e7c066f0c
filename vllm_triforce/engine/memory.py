"""The memory TriForce allocates beside vLLM's KV cache, reserved before vLLM sizes it.

vLLM sizes the KV cache from what is free after its profile run
(`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py; `CPUWorker`'s on CPU),
which runs before the proposer allocates anything of its own. Unreserved, TriForce's
buffers would come on top of `gpu_memory_utilization` and could OOM a GPU. So the
`kv_reservation` patch hands vLLM the smaller budget the proposer's `reserve_memory` leaves:
the most KV blocks n for which n x (KV block + per-block part) + the fixed part sized for n
blocks fit what is available (`MemoryPlan.blocks_for`), where

* the per-block part (scales with the cache) is the block summaries, one key-sized vector
  per target layer and KV head, by default (`compact_summaries`) coded in a byte a value
  with a float32 scale (core/summary_coding.py), else in `summary_dtype` (the KV cache's,
  or the model's for an fp8 / int8 cache), plus an int32 count (≈ KV bytes / (2 ×
  block_size) for the target's layers in bf16); plus, with `key_variance` (the default for
  `retrieval`), the keys' square deviations: one more such vector, coded, or in float32,
  or, with `compact_key_variance`, 8 values per target layer and KV head in
  `summary_dtype` (core/summaries.py's bands: at head size 128 in bf16, 1/16 of the key
  sums); plus, for `quest`, two more (per-channel key min
  and max); plus, only with `allow_full_key_copy`, a copy of every committed key (h2o,
  topk_oracle) (`summary_parts` lists them); plus, with FLEX_ATTENTION, the block map
  (`physical_to_logical`) of one metadata builder per target layer, made for a middle
  pass's limits (engine/shape.py `PassLimits`: at most BUILDER_PASS_REQUESTS = 32
  requests, `per_layer_builder_bytes`; FLASHINFER's builders are all fixed part): 8 B per
  block per request of a pass and layer (Llama-3.1-8B: 8.3 KiB per 2 MiB block);
* the fixed part (`MemoryPlan.sized(n)`, a `Sizing`; each buffer's bound in
  engine/buffers.py) is: the probability rows, float32
  distributions over the vocabulary (`vocabulary_rows`: per drafting request, the
  [gamma2, V] draft probabilities handed to vLLM, preallocated once, and a middle round's
  logits and proposals; plus a fixed amount for the rest of a round's vocabulary work,
  done in chunks of requests); the scratch, the larger of a block selection's
  (`selection_scratch_bytes`: score tensors of one chunk of the selecting requests'
  tables, chunked reads of the summaries, the queries), a lazy read of summaries from the
  KV cache (`lazy_read_bytes`) and a fold of a prefill's keys into the summaries
  (`fold_scratch_bytes`), which never run at the same time; and the per-layer builders'
  fixed part (FLEX's index tables, 5-7 MB per layer at 128K: 6.3 MB at gamma1 = 1).

What can exist bounds the fixed part, so that TriForce's share of a cache stays small,
however small or large: no table is wider than the blocks the cache holds; the drafting
cap, the requests that may draft in one step, is vLLM's max_num_seqs (every request it
schedules) or, where the cache's share cannot hold their rows, the most whose probability
rows and scratch fit `scaled_limit` of the cache (1/FIXED_SHARE_DIVISOR of it, and at most
LARGE_CACHE_FIXED_BYTES + 1/LARGE_CACHE_SHARE_DIVISOR of it: a large cache is bought for
KV), and at least one; and one chunked read (of summaries, of keys from the KV cache, a
fold piece, a pass's stacked queries) copies at most 1/CHUNK_SHARE_DIVISOR of that limit
(1/256 of a small cache's bytes; at least one block's keys in float32, at most
SCORE_CHUNK_BYTES). The start-up log (`describe_reservation`) gives the KV blocks TriForce
leaves against those plain vLLM would make of the same memory, what each of TriForce's
buffers costs, how many requests may draft and how much cache would let every one draft.
The proposer allocates by the `Sizing` it reserved: its read chunk
(`BlockSummaries.chunk_bytes`, which every chunked read obeys), the hand-off buffer's rows
and the depth planner's cap (its drafting count).
A budget left without room for one `max_model_len` request is refused with `KVBudgetError`,
which names each part of the reservation and the fix.

Worked example (SmolLM2-135M float32 on CPU, block 32, 30 layers × 3 KV heads × 64, no
draft, 1 GiB budget, max_num_seqs 8, gamma2 6, V 49,152, `key_variance` false,
`compact_summaries` false, no selection or fold scratch): a KV block is 30 × 2 × 32 × 3 × 64
× 4 = 1,474,560 B and its summary 30 × 3 × 64 × 4 + 4 = 23,044 B; fixed = (8 × (6 + 1) + 1 +
3 × 8 + 8 × 8 + 13 × 8) rows × 49,152 × 4 = 249 × 196,608 = 48,955,392 B (per request its 6
hand-off rows and a round's logits; the spare row; one chunk of 8 requests' vocabulary
work), within 1/16 of 684 blocks' KV (63,037,440 B), so all 8 requests may draft; blocks =
(2^30 − 48,955,392) // 1,497,604 = 684, so vLLM gets 684 × 1,474,560 B and 65,142,784 B stay
reserved. With the default `key_variance` (per channel) the summary is 2 × 23,040 + 4 =
46,084 B and blocks = (2^30 − 48,955,392) // 1,520,644 = 673; coded as well
(`compact_summaries`, the default: a byte a value and a float32 scale per layer and KV head)
2 × 30 × 3 × (64 + 4) + 4 = 12,244 B and (2^30 − 48,955,392) // 1,486,804 = 689 blocks; with
`compact_key_variance` (8 bands, float32 like these summaries) 23,044 + 30 × 3 × 8 × 4 =
25,924 B, and the channel profile's 23,040 B join the fixed part: (2^30 − 48,978,432) //
1,500,484 = 682 blocks; with `quest` 3 × 23,040 + 4 = 69,124 B and 663 blocks.

Worked example, a small cache (the same model with `key_variance` on in float summaries
(`compact_summaries` false), max_num_seqs 256 (the `LLM` default on CPU), max_model_len
4,096 (128 blocks), 4,096 batched tokens, gamma2 4, 9 query heads, 384 MiB): the most blocks
is 252, whose KV is 371,589,120 B. One read chunk is 1/256 of that, 1,451,520 B (63 tokens'
keys of every layer); the fold's five pieces, 7,257,600 B, are the largest scratch (a
selection's 6,465,600 B). Two drafting requests' probability rows (2 × (4 + 1) + 1 + 3 × 2 +
8 × 2 + 13 × 2 = 59 rows, 11,599,872 B) and the scratch make 18,857,472 B, within 1/16 of
the KV (23,224,320 B); a third request's would make 24,559,104 B. So 252 × 1,520,644 +
18,857,472 = 402,059,760 B fit (253 blocks would not), vLLM gets 252 blocks, and 31,064,064
B (29.6 MiB, 7.7%) stay reserved: 11,613,168 B of summaries, the 18,857,472 B and a
remainder no block fits in; 2 of the 256 sequences may draft at once, and the log says that
a KV cache of 197,553 blocks (277,809 MiB) would let all 256 draft. Sized for 256 drafting
requests and 64 MiB reads whatever the cache, the fixed part would be 1,277 MiB: more than
three times the budget.

Worked example at scale (Llama-3.1-8B: bf16 KV cache, block 16, 32 layers × 8 KV heads ×
128, 32 query heads, V 128,256; two levels, gamma2 6, max_model_len 131,072, 8,192 batched
tokens, max_num_seqs 256): a KV block is 32 × 2 × 16 × 8 × 128 × 2 = 2,097,152 B. Its
summaries, coded (the default), are 32 × 8 × (128 + 4) + 4 = 33,796 B of key sums, their
scales and a count, and 33,792 B of key variance (67,588 B in all, under 1/31 of the
block); with `compact_summaries` false 32 × 8 × 128 × 2 + 4 = 65,540 B of bf16 key sums
and a count (1/32 of the block) plus 32 × 8 × 128 × 4 = 131,072 B of float32 variance
(196,612 B, 3/32); with `compact_key_variance` the sums and 32 × 8 × 8 bands × 2 = 4,096 B
in bf16 (69,636 B, 17/512). A 128K-token request holds 8,192 blocks: 16 GiB of KV and 0.52
GiB of coded summaries (1.5 GiB of float ones). On an H200 at gpu_memory_utilization 0.9
(vLLM's default), plain vLLM made 55,604 blocks of 111,208 MiB
(benchmarks/gpu/results.json). Beside such a cache the rows and scratch may take 192 MiB
+ 1/256 of the KV (610 MiB) and a read copies at most a 16th of that (38 MiB), so 15
requests draft at once: 466 probability rows of 128,256 × 4 B (per request its 6 hand-off
rows, patches/handoff_rows.py, and a round's logits; a chunk of 15 requests' vocabulary
work, 24 rows each; the spare row), 228.0 MiB, and a selection's scratch over tables of up
to 8,192 blocks, 357.1 MiB. So 53,584 blocks fit with coded summaries, 96.4% of plain
vLLM's, and 4,040 MiB stay reserved (3,453.9 MiB of summaries, 585.1 MiB of rows and
scratch, 1.0 MiB no block fits in); 53,533 (96.3%) with `compact_key_variance`; with float
summaries 50,574 (91.0%: 9,482.8 MiB of summaries). On an 80 GB GPU (~52 GB for the cache
after 16 GB of weights and vLLM's activations: 24,795 plain blocks) the limit is 378 MiB,
reads copy 23.6 MiB and 11 requests draft: 23,839 blocks with coded summaries (96.1%),
22,511 with float ones (90.8%). vLLM's default of 1,024 sequences changes none of this:
the limit, not max_num_seqs, caps the drafting requests (the log says that 1.7 TiB of KV
cache would let all 1,024 draft).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_triforce.config import TriForceConfigError
from vllm_triforce.core import reads
from vllm_triforce.core.policy_facts import SummaryKinds
from vllm_triforce.core.summaries import BlockSummaries, variance_dtype, variance_width
from vllm_triforce.core.summary_coding import SCALE_BYTES
from vllm_triforce.engine.buffers import (FLOAT32_BYTES, fold_scratch_bytes, lazy_read_bytes,
                                          round_graph_bytes, selection_graph_bytes,
                                          selection_scratch_bytes, vocabulary_rows)

if TYPE_CHECKING:
    from vllm_triforce.engine.shape import EngineShape

COUNT_BYTES = 4  # int32 committed-token count per block
MiB = 2**20
# The fixed part follows the cache it serves (module docstring): the drafting requests'
# probability rows and scratch take at most 1/16 of the KV cache's bytes and at most
# LARGE_CACHE_FIXED_BYTES + 1/256 of them (`scaled_limit`: the smaller of the two from a
# cache of 3.2 GiB up, for a large cache is bought for KV: with compact summaries TriForce
# keeps 96% of plain vLLM's blocks of an 80 GB GPU at Llama-3.1-8B's shape), and one
# chunked read at most 1/16 of that limit (1/256 of a small cache; the fold's FOLD_COPIES
# pieces: 5/16 of the limit), so the scratch grows no faster than the limit and a larger
# cache never lets fewer requests draft. From a limit of 1 GiB (a cache of 208 GiB) reads
# take chunks of the full SCORE_CHUNK_BYTES.
FIXED_SHARE_DIVISOR = 16
LARGE_CACHE_FIXED_BYTES = 192 * MiB
LARGE_CACHE_SHARE_DIVISOR = 256
CHUNK_SHARE_DIVISOR = 16


def scaled_limit(kv_bytes: int) -> int:
    """The most the drafting requests' probability rows and scratch may take beside a KV
    cache of `kv_bytes`: 1/FIXED_SHARE_DIVISOR of it, and at most LARGE_CACHE_FIXED_BYTES
    + 1/LARGE_CACHE_SHARE_DIVISOR of it. Example: 384 MiB -> 24 MiB; 100 GiB -> 592 MiB."""
    return min(kv_bytes // FIXED_SHARE_DIVISOR,
               LARGE_CACHE_FIXED_BYTES + kv_bytes // LARGE_CACHE_SHARE_DIVISOR)


def summary_parts(shape: EngineShape) -> dict[str, int]:
    """Bytes per KV block of each store of the block summaries an engine of `shape` keeps
    (core/summaries.py `BlockSummaries`, as `allocate_summaries` makes it): the key sums in
    `summary_dtype` (or coded: a byte a value and a float32 scale per layer and KV head,
    core/summary_coding.py) and the count; per `shape.kinds`, the key variance (per channel
    in float32 or coded, or per band: `variance_width`, `variance_dtype`), the key bounds
    (min and max), a copy of the keys."""
    kinds, dtype = shape.kinds, shape.summary_dtype
    heads = shape.num_layers * shape.num_kv_heads  # one vector per target layer and KV head
    key_bytes = heads * shape.head_dim * dtype.itemsize
    coded_bytes = heads * (shape.head_dim + SCALE_BYTES)  # one byte a value, a scale a row
    parts = {"mean keys": (coded_bytes if kinds.coded else key_bytes) + COUNT_BYTES}
    if kinds.keep_variance and kinds.coded:
        parts["key variance"] = coded_bytes
    elif kinds.keep_variance:
        width = variance_width(shape.head_dim, kinds.compact_variance)
        element = variance_dtype(dtype, kinds.compact_variance).itemsize
        parts["key variance"] = heads * width * element
    if kinds.keep_bounds:
        parts["key bounds"] = 2 * key_bytes
    if kinds.keep_keys:
        parts["key copy"] = key_bytes * shape.block_size
    return parts


def summary_fixed_bytes(shape: EngineShape) -> int:
    """Bytes of the block summaries that do not scale with the cache: with a compact key
    variance, the channel profile (`BlockSummaries.channel_profile`: one float32 per target
    layer, KV head and channel; Llama-3.1-8B: 128 KiB); else 0."""
    kinds = shape.kinds
    if not (kinds.keep_variance
            and variance_width(shape.head_dim, kinds.compact_variance) < shape.head_dim):
        return 0
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * FLOAT32_BYTES


class KVBudgetError(TriForceConfigError):
    """The KV budget vLLM has holds no `max_model_len` request once TriForce's reservation
    is taken out of it (raised before vLLM's own, generic, check)."""


@dataclass(frozen=True)
class Sizing:
    """TriForce's fixed part for a KV cache of `num_blocks` (None: one that bounds nothing)
    and the limits the proposer allocates by."""
    num_blocks: int | None
    drafting: int           # requests that draft in one step: the depth planner's cap,
                            # the hand-off buffer's rows
    chunk_bytes: int        # the most one chunked read copies (BlockSummaries.chunk_bytes)
    probability_bytes: int  # `vocabulary_rows` for `drafting` requests, float32
    scratch_bytes: int      # the largest of the selection's, a lazy read's and the fold's
    builder_bytes: int      # the per-layer builders' fixed part
    round_bytes: int = 0    # `round_graphs`: buffers and graph pool (buffers.round_graph_bytes)
    profile_bytes: int = 0  # the summaries' channel profile (`summary_fixed_bytes`)

    @property
    def scaled_bytes(self) -> int:
        """The part the drafting cap keeps within `scaled_limit` of the KV."""
        return self.probability_bytes + self.scratch_bytes

    @property
    def fixed_bytes(self) -> int:
        return self.scaled_bytes + self.builder_bytes + self.round_bytes + self.profile_bytes


@dataclass(frozen=True)
class MemoryPlan:
    kv_bytes_per_block: int       # every layer of the KV-cache group (target and draft)
    summary_bytes_per_block: int  # TriForce's per-block state (and per-layer builders')
    shape: EngineShape            # what the fixed part is sized from (`sized`)
    builder_bytes: int = 0        # the per-layer builders' fixed part
    cuda_graphs: bool = False     # `round_graphs` captures CUDA graphs (their pool counts)

    @classmethod
    def for_engine(cls, shape: EngineShape, kv_bytes_per_block: int,
                   builders: tuple[int, int] = (0, 0),
                   cuda_graphs: bool = False) -> "MemoryPlan":
        """The plan of an engine of `shape` (engine/shape.py; `EngineShape.memory_plan`
        calls this) beside a KV cache of `kv_bytes_per_block`. `builders`: (bytes per block,
        fixed bytes) of the per-layer attention-metadata builders a stateful backend needs
        (`EngineShape.builder_bytes`). From the shape: the optional block state kept
        (`kinds`, which the proposer also allocates from), the summaries' element
        (`summary_dtype`: the KV cache's unless that is fp8 or int8), the drafting cap
        before the cache bounds it (`max_drafting`: vLLM's max_num_seqs); its
        `max_blocks` (0: a max_model_len of 0) and `num_q_heads` size the block
        selection's scratch (`selection_scratch_bytes`, `lazy_read_bytes`; 0 blocks: left
        out, as in the first worked example above), its `max_batched_tokens` the fold's
        (`fold_scratch_bytes`; 0: left out). `cuda_graphs`: with `round_graphs`, the middle
        passes are CUDA graphs, whose pool is reserved too (`round_graph_bytes`)."""
        summary = sum(summary_parts(shape).values())
        return cls(kv_bytes_per_block, summary + builders[0], shape, builders[1], cuda_graphs)

    @property
    def key_row_bytes(self) -> int:
        """One token's keys of every target layer in float32 (one block's summary row)."""
        shape = self.shape
        return shape.num_layers * shape.num_kv_heads * shape.head_dim * FLOAT32_BYTES

    def chunk_bytes(self, kv_bytes: int | None) -> int:
        """The most one chunked read copies, for a KV cache of `kv_bytes` (None: one that
        bounds nothing): 1/CHUNK_SHARE_DIVISOR of its `scaled_limit` (1/256 of a small
        cache), at most SCORE_CHUNK_BYTES, and at least one block's keys in float32 (what a
        lazy read of the KV cache copies at the least)."""
        most = reads.SCORE_CHUNK_BYTES
        share = (most if kv_bytes is None
                 else min(most, scaled_limit(kv_bytes) // CHUNK_SHARE_DIVISOR))
        return max(share, self.shape.block_size * self.key_row_bytes)

    def sized(self, num_blocks: int | None) -> Sizing:
        """The fixed part for a cache of `num_blocks` (None: one that bounds nothing), with
        the most drafting requests, up to the shape's `max_drafting`, whose rows and scratch
        fit `scaled_limit` of its KV (at least one; both grow with the count, so a
        bisection finds it)."""
        kv_bytes = None if num_blocks is None else num_blocks * self.kv_bytes_per_block
        chunk = self.chunk_bytes(kv_bytes)
        most = self.shape.max_drafting
        if kv_bytes is None:
            return self._sized(most, chunk, num_blocks)
        limit = scaled_limit(kv_bytes)

        def too_many(drafting: int) -> bool:
            return self._sized(drafting, chunk, num_blocks).scaled_bytes > limit

        fitting = bisect.bisect_left(range(1, most + 1), True, key=too_many)
        return self._sized(max(fitting, 1), chunk, num_blocks)

    def _sized(self, drafting: int, chunk: int, num_blocks: int | None) -> Sizing:
        shape = self.shape
        width = shape.max_blocks if num_blocks is None else min(shape.max_blocks, num_blocks)
        geometry = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        scratch = fold_scratch_bytes(shape.max_batched_tokens, *geometry, chunk)
        if width > 0:
            scratch = max(scratch,
                          selection_scratch_bytes(drafting, shape.num_layers, shape.max_blocks,
                                                  shape.num_kv_heads, shape.head_dim,
                                                  shape.num_q_heads, chunk, num_blocks),
                          lazy_read_bytes(drafting * width, *geometry, shape.block_size, chunk))
        rows = vocabulary_rows(drafting, shape.gamma2, shape.gamma1, shape.hands_off_probs)
        return Sizing(num_blocks, drafting, chunk, rows * shape.vocab_size * FLOAT32_BYTES,
                      scratch, self.builder_bytes, self._round_bytes(drafting),
                      summary_fixed_bytes(shape))

    def _round_bytes(self, drafting: int) -> int:
        """`round_graphs`' buffers (and graph pool) for `drafting` requests; 0 without it."""
        shape = self.shape
        if not shape.cfg.round_graphs:
            return 0
        draft = shape.draft_round_bounds(drafting) if shape.has_draft else None
        bounds, blocks = shape.round_bounds(drafting), shape.blocks
        selection = 0
        if shape.cfg.selection_graphs:  # the longest shortlist a Selector keeps
            listed = max(shape.cfg.middle_shortlist * blocks.num_retrieved, blocks.max_chosen)
            selection = selection_graph_bytes(bounds, shape.num_layers, listed,
                                              blocks.retrieval_sink_blocks, shape.max_blocks,
                                              blocks.max_selected, self.cuda_graphs)
        return selection + round_graph_bytes(bounds, shape.num_layers, shape.num_q_heads,
                                             shape.num_kv_heads, shape.head_dim,
                                             shape.vocab_size, shape.summary_dtype.itemsize,
                                             shape.capture_tokens, self.cuda_graphs, draft,
                                             shape.window_groups, shape.max_blocks + 1)

    @property
    def fixed_bytes(self) -> int:
        """The fixed part at its largest: for a cache that bounds nothing."""
        return self.sized(None).fixed_bytes

    def footprint(self, num_blocks: int) -> int:
        """KV, summaries and the fixed part of a cache of `num_blocks`."""
        per_block = self.kv_bytes_per_block + self.summary_bytes_per_block
        return num_blocks * per_block + self.sized(num_blocks).fixed_bytes

    def blocks_for(self, available: int) -> int:
        """The most KV blocks whose footprint fits `available` bytes."""
        most = max(available, 0) // (self.kv_bytes_per_block + self.summary_bytes_per_block)
        num_blocks = bisect.bisect_right(range(most + 1), available, key=self.footprint) - 1
        # the fixed part grows with the cache, by less than a block's bytes a block in every
        # plan seen; should a step of the drafting cap ever outgrow that, step down to a fit
        while num_blocks > 0 and self.footprint(num_blocks) > available:
            num_blocks -= 1
        return max(num_blocks, 0)

    def blocks_for_drafting(self, drafting: int) -> int:
        """The fewest KV blocks whose cache lets `drafting` requests draft at once (at
        most the shape's `max_drafting`): the drafting cap grows with the cache."""
        unbounded = self.sized(None).scaled_bytes
        kv_bytes = max(unbounded * FIXED_SHARE_DIVISOR,  # `scaled_limit` bounds nothing there
                       (unbounded - LARGE_CACHE_FIXED_BYTES) * LARGE_CACHE_SHARE_DIVISOR)
        most = -(-kv_bytes // self.kv_bytes_per_block)
        return bisect.bisect_left(range(most + 1), True,
                                  key=lambda n: self.sized(n).drafting >= drafting)

    def kv_budget(self, available: int) -> int:
        """Bytes vLLM may give the KV cache so that KV + summaries + fixed fit `available`."""
        return self.blocks_for(available) * self.kv_bytes_per_block

    def available_for(self, kv_bytes: int) -> int:
        """The inverse of `kv_budget`: bytes to hand the sizing so that at least `kv_bytes`
        of KV cache remain after the reservation (for a KV size chosen before sizing)."""
        return self.footprint(-(-kv_bytes // self.kv_bytes_per_block))


def describe_reservation(plan: MemoryPlan, available: int, num_blocks: int) -> str:
    """The start-up line of `reserve_memory`: the KV blocks TriForce leaves vLLM against
    those plain vLLM would make of the same `available` bytes, the reservation's share of
    them, each of its buffers and the remainder (less than one block of KV + summaries,
    which no block fits in)."""
    sizing = plan.sized(num_blocks)
    plain = max(available, 0) // plan.kv_bytes_per_block
    kept = 100 * num_blocks / plain if plain else 100.0
    reserved = available - num_blocks * plan.kv_bytes_per_block
    remainder = available - plan.footprint(num_blocks)
    share = 100 * reserved / available if available > 0 else 0.0
    return (f"the KV cache gets {num_blocks} blocks, {kept:.1f}% of the {plain} plain vLLM "
            f"would make of {available / MiB:.1f} MiB; reserved {reserved / MiB:.1f} MiB "
            f"({share:.1f}%) before KV-cache sizing: {_parts(plan, sizing, num_blocks)}, "
            f"remainder {remainder / MiB:.1f} MiB; {_drafting(plan, sizing)}, reads of at "
            f"most {sizing.chunk_bytes / MiB:.1f} MiB")


def _drafting(plan: MemoryPlan, sizing: Sizing) -> str:
    """How many requests may draft at once, and, when the cache's share holds fewer than
    max_num_seqs, what would let every one draft."""
    most = plan.shape.max_drafting
    if sizing.drafting >= most:
        return f"every request (max_num_seqs {most}) may draft at once"
    wanted = plan.blocks_for_drafting(most) * plan.kv_bytes_per_block
    limit = scaled_limit(sizing.num_blocks * plan.kv_bytes_per_block)
    return (f"{sizing.drafting} of max_num_seqs {most} requests may draft at once (their "
            f"probability rows and scratch take at most {limit / MiB:.1f} MiB beside this KV "
            f"cache: 1/{FIXED_SHARE_DIVISOR} of it, and at most "
            f"{LARGE_CACHE_FIXED_BYTES / MiB:.0f} MiB + 1/{LARGE_CACHE_SHARE_DIVISOR}; a KV "
            f"cache of {wanted / MiB:.1f} MiB would let all {most} draft)")


def _parts(plan: MemoryPlan, sizing: Sizing, num_blocks: int) -> str:
    """Each of TriForce's buffers beside a KV cache of `num_blocks`, in MiB: the block
    summaries (each of their stores, `summary_parts`), a stateful backend's per-layer
    block maps, the probability rows, the scratch, the per-layer builders' fixed part."""
    def mib(nbytes: int) -> str:
        return f"{nbytes / MiB:.1f} MiB"

    stores = summary_parts(plan.shape)
    each = ", ".join(f"{name} {mib(num_blocks * b)}" for name, b in stores.items())
    if sizing.profile_bytes:
        each += f", channel profile {mib(sizing.profile_bytes)}"
    summaries = num_blocks * sum(stores.values()) + sizing.profile_bytes
    parts = [f"block summaries {mib(summaries)} ({each})"]
    maps = plan.summary_bytes_per_block - sum(stores.values())
    if maps:
        parts.append(f"per-layer builders' block maps {mib(num_blocks * maps)}")
    parts += [f"probability rows {mib(sizing.probability_bytes)} "
              f"({sizing.drafting} drafting requests)",
              f"scratch {mib(sizing.scratch_bytes)}"]
    if sizing.builder_bytes:
        parts.append(f"per-layer builders {mib(sizing.builder_bytes)}")
    if sizing.round_bytes:
        parts.append(f"round graphs' buffers{' and pool' if plan.cuda_graphs else ''} "
                     f"{mib(sizing.round_bytes)}")
    return ", ".join(parts)


def check_one_request(plan: MemoryPlan, available: int, num_blocks: int, needed: int,
                      max_model_len: int) -> None:
    """Refuse a budget whose KV, after the reservation, holds less than `needed` bytes (what
    vLLM's start-up check asks for one `max_model_len` request:
    `KVCacheSpec.max_memory_usage_bytes`, vllm/v1/kv_cache_interface.py, 0.32.0) with one
    error naming each part of the reservation and the fix, instead of vLLM's."""
    kv_bytes = num_blocks * plan.kv_bytes_per_block
    if kv_bytes >= needed:
        return
    wanted = plan.available_for(needed)
    longest = num_blocks * plan.shape.block_size
    raise KVBudgetError(
        f"TriForce: the KV cache cannot hold one request of max_model_len {max_model_len} "
        f"({needed / MiB:.1f} MiB of KV) once TriForce's buffers are reserved: of "
        f"{available / MiB:.1f} MiB, {(available - kv_bytes) / MiB:.1f} MiB are reserved "
        f"({_parts(plan, plan.sized(num_blocks), num_blocks)}), leaving {num_blocks} blocks "
        f"({kv_bytes / MiB:.1f} MiB). Give the KV cache at least {wanted / MiB:.1f} MiB "
        f"(kv_cache_memory_bytes={wanted}; VLLM_CPU_KVCACHE_SPACE on a CPU; or a higher "
        f"gpu_memory_utilization), or lower max_model_len"
        + (f" to at most {longest}." if longest else "."))


def allocate_summaries(kinds: SummaryKinds, num_layers: int, num_blocks: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype,
                       device=None, chunk_bytes: int | None = None) -> BlockSummaries:
    """The block summaries `MemoryPlan.for_engine` reserved room for (`kinds`: its shape's),
    read by chunks of at most `chunk_bytes` (`Sizing.chunk_bytes`; None: SCORE_CHUNK_BYTES)."""
    return BlockSummaries(num_layers, num_blocks, num_kv_heads, head_dim, block_size,
                          dtype=dtype, device=device, chunk_bytes=chunk_bytes,
                          **dataclasses.asdict(kinds))


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
