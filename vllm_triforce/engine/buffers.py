"""Upper bounds of the buffers TriForce allocates beside the KV cache, each read from the
code that allocates it and checked by tests/test_memory_plan.py with torch's memory
profiler: the vocabulary-wide probability rows (`vocabulary_rows`), and the transient
scratch of a block selection (`selection_scratch_bytes`), a lazy read of summaries from the
KV cache (`lazy_read_bytes`) and a fold of a prefill's keys (`fold_scratch_bytes`). How much
of each the engine reserves, for how many drafting requests and which read chunk, is
engine/memory.py's to decide.

What grows with the drafting requests, and what does not. Every drafting request holds its
own rows only where they cannot be shared: the gamma2 rows handed to vLLM (its rejection
sampler reads them as float32) and, during a middle round, the passes' logits (what the
model returns) and the small draft's proposal distributions. Everything else over the
vocabulary (the distributions a round verifies with, `verify`'s copies, the draws) is done
in chunks of at most MIDDLE_CHUNK_ROWS token rows (engine/middle.py), so it is a fixed
amount whatever the batch; so is a selection's scratch: requests select in chunks whose
tables hold at most SELECTION_CHUNK_BLOCKS blocks together (core/selection.py
`selection_chunk_requests`). The cost of chunking is a few more operations per
round once a batch passes a chunk (one chunk up to 64 requests of one token: the host
does the same work at batch 8 and 64).

Terms: R drafting requests, L target layers, H KV heads, D head size, B blocks per table;
a "read chunk" is the most one chunked read of the summaries or of the KV cache copies
(`reads.read_limit`: SCORE_CHUNK_BYTES, or the engine's smaller one).
"""

from __future__ import annotations

from vllm_triforce.core import reads
from vllm_triforce.core.selection import selection_chunk_requests
from vllm_triforce.core.verify import SAMPLING_CHUNK_ROWS

# `RetrievalStep._queries_at` (engine/retrieval_level.py) stacks a pass's queries whole up
# to this size (a middle round's: 32 requests of a few tokens, e.g. Llama-3.1-8B 32 x 3
# tokens x 32 layers x 4,096 x 2 B = 24 MiB at most with gamma1 = 2; at batch 8 and
# gamma1 = 0, 2 MiB) and one read chunk (a small cache's is small: engine/memory.py
# reserves the smaller of the two).
STACKED_QUERIES_BYTES = 32 * 2**20

FLOAT32_BYTES = 4
# vocabulary-wide temporaries per row of `sampling_probs` (`vocabulary_rows` lists them),
# with room to spare (benchmarks/explore/sampling_chunks.py measures them on a GPU,
# tests/test_memory_plan.py on a CPU)
SAMPLING_ROWS_PER_ROW = 13
# The middle round's vocabulary-wide work past the pass (distributions, verification,
# draws, the copy into the hand-off buffer) runs on at most this many token rows at once
# (engine/middle.py, engine/draft_level.py): one sampling chunk (core/verify.py)
MIDDLE_CHUNK_ROWS = SAMPLING_CHUNK_ROWS
# the hand-off buffer's one spare row (engine/middle.py `HandOffBuffer`)
HAND_OFF_SPARE_ROWS = 1


def middle_chunk_requests(gamma1: int) -> int:
    """Requests of one chunk of a middle round's vocabulary-wide work: as many whole
    requests of gamma1 + 1 token rows as MIDDLE_CHUNK_ROWS holds, at least one.
    Example: 64 without a small draft, 21 at gamma1 = 2."""
    return max(1, MIDDLE_CHUNK_ROWS // (gamma1 + 1))


def vocabulary_rows(drafting: int, gamma2: int, gamma1: int, hand_off: bool = True) -> int:
    """Vocabulary-wide float32 rows TriForce may hold at once beyond vLLM's own, with
    `drafting` requests drafting in a step (the drafting cap, `Sizing.drafting`, which
    engine/depth.py `cap_drafting` keeps to): an upper bound read from the code, which
    tests/test_memory_plan.py checks against the peak the torch memory profiler measures
    in `propose` (152K vocabulary, top-p, gamma2 6).

    Per drafting request (a pass runs gamma1 + 1 tokens of one):
    * gamma2: the probabilities handed to vLLM (`hand_off`'s buffer, preallocated, one row
      per drafting request: patches/handoff_rows.py), which the middle rounds write into as
      they go (engine/middle.py);
    * gamma1 + 1: the retrieval pass's logits (a draft step's one row comes before them);
    * gamma1 with a small draft: its proposals' distributions, kept for the verification.
    Per chunk of C = `middle_chunk_requests` requests (at most `drafting`), T = C (gamma1 + 1)
    token rows: 3 T (the chunk's distributions, their per-request layout, `verify`'s float32
    copy; the copy into the hand-off buffer comes after that copy is freed), 8 C
    (`verify`'s final distribution: target and draft rows at the first rejection, the
    residual, the choice, and its float64 cumulative sum, 2 rows each, twice) and the
    temporaries of `sampling_probs`, SAMPLING_ROWS_PER_ROW per row of at most
    SAMPLING_CHUNK_ROWS rows (a float32 copy, sort values, int64 order, softmax, cumulative
    mass, the mask; on CUDA the sort's own buffers).
    Fixed besides: the hand-off buffer's spare row (engine/middle.py `HandOffBuffer`).
    `hand_off` False (Model Runner V2, whose verifier reads the middle level's logits from
    its own `draft_logits`, engine/mrv2/): no hand-off rows and no spare row.
    Example, gamma2 6, no small draft: 7 rows per request and, from 64 requests up, a
    fixed 1 + 3 x 64 + 8 x 64 + 13 x 64 = 1,537 rows; without the hand-off, 1 row per
    request and 1,536 fixed."""
    per_request = (gamma2 if hand_off else 0) + (gamma1 + 1) + gamma1
    chunk = min(drafting, middle_chunk_requests(gamma1))
    tokens = chunk * (gamma1 + 1)
    return (drafting * per_request + (HAND_OFF_SPARE_ROWS if hand_off else 0) + 3 * tokens
            + 8 * chunk + SAMPLING_ROWS_PER_ROW * min(SAMPLING_CHUNK_ROWS, tokens))


# `selection_scratch_bytes`: score tensors [R, L, B] float32 alive at once (the dots of
# a scoring pass and their concatenation, the division by counts, the variance term's
# scores, `select_blocks`' NaN-free and masked copies), "all" strategies' [L, N, R] dots
# (N: the store's blocks, read whole when N <= 2 R B), and CHUNK_READS chunked reads (the
# gathered rows, their float32 copy, a product's contiguous operand): read from
# core/summary_policies.py, core/reads.py and core/selection.py, checked by tests/test_memory_plan.py
# (`test_selection_scratch_fits_its_reservation`)
SCORE_COPIES = 6
CHUNK_READS = 3


def selection_scratch_bytes(drafting: int, num_layers: int, max_blocks: int,
                            num_kv_heads: int, head_dim: int, num_q_heads: int,
                            chunk_bytes: int | None = None, num_blocks: int | None = None) -> int:
    """Bytes a block selection may hold at once beyond the summaries, for `drafting`
    requests selecting over tables of `max_blocks` (no wider than the `num_blocks` the
    cache holds; None: unbounded), R at a time (core/selection.py
    `selection_chunk_requests`: at most SELECTION_CHUNK_REQUESTS, and tables of at most
    SELECTION_CHUNK_BLOCKS blocks together, or one request): SCORE_COPIES score tensors,
    the "all" strategy's dots over the store, CHUNK_READS chunks of the summary store (each
    at most `chunk_bytes`, the engine's read chunk, None: SCORE_CHUNK_BYTES, or the whole
    read where that is smaller; between middle rounds one of them is the shortlist's copy,
    `RetrievalPolicy.listed_copy`, kept for the step's re-rankings, which then read no
    store), a pass's stacked queries (at most STACKED_QUERIES_BYTES and one chunk) and
    three float32 copies of the R requests' queries (one of them the gathered queries of
    every selecting request: past one chunk, the others' count once more). Llama-3.1-8B at
    128K (B = 8,192, L = 32, 8 x 128 KV, 32 query heads), a cache of 22,700 blocks, 32
    drafting requests (R = 32: 262,144 / 8,192): 201 MB of scores + 93 MB of dots + 201 MB
    of reads + 84 MB of queries = 0.58 GB, and 0.5 MB of queries more per drafting request
    past 32; at 4 requests 25 + 12 + 201 + 40 MB = 0.28 GB."""
    chunk = _read_chunk(chunk_bytes)
    requests = min(drafting, selection_chunk_requests(max_blocks))
    store = 2 * requests * max_blocks  # "all" reads the store only when it is this small
    if num_blocks is not None:
        max_blocks, store = min(max_blocks, num_blocks), min(store, num_blocks)
    scores = (SCORE_COPIES * max_blocks + store) * requests * num_layers * FLOAT32_BYTES
    whole_read = requests * max_blocks * num_layers * num_kv_heads * head_dim * FLOAT32_BYTES
    # three copies of a chunk's queries, one of them the gathered queries of every
    # selecting request (the rest of those, past one chunk, counted once more)
    queries = ((3 * requests + drafting - requests) * num_layers * num_q_heads * head_dim
               * FLOAT32_BYTES)
    return (scores + CHUNK_READS * min(chunk, whole_read) + min(STACKED_QUERIES_BYTES, chunk)
            + queries)


# `lazy_read_bytes`: float32-sized copies of a chunk of blocks' keys [L, n, H, bs, D] alive
# at once while the lazy summaries read them from the KV cache (the float32 keys, their
# square deviations in BlockSummaries.block_values, one layer's gather; the compiled read
# holds only the first, its other buffers being a value per block, not per key): read from
# engine/summary_keeper.py `BlockReads` and core/summaries.py
LAZY_READ_COPIES = 3


def lazy_read_bytes(num_read_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    block_size: int, chunk_bytes: int | None = None) -> int:
    """Bytes setting block summaries from the KV cache may hold at once, for at most
    `num_read_blocks` blocks (the drafting requests' tables): LAZY_READ_COPIES reads of at
    most `chunk_bytes` of float32 keys (None: SCORE_CHUNK_BYTES), or one block's where that
    is more."""
    block_keys = num_layers * num_kv_heads * block_size * head_dim * FLOAT32_BYTES
    read = max(_read_chunk(chunk_bytes) // block_keys, 1) * block_keys
    return LAZY_READ_COPIES * min(read, num_read_blocks * block_keys)


# `fold_scratch_bytes`: float32-sized copies of one fold piece's keys [L, n, H, D] alive at
# once in BlockSummaries.add_committed (the stacked keys, their float32 copy, the gathered
# block means, the deviations; the runs' sums are 1 / block_size of that): read from
# core/summaries.py, with room to spare; tests/test_memory_plan.py
# (`test_fold_scratch_fits_its_reservation`) checks it
FOLD_COPIES = 5


def fold_scratch_bytes(max_batched_tokens: int, num_layers: int, num_kv_heads: int,
                       head_dim: int, chunk_bytes: int | None = None) -> int:
    """Bytes folding one pass's committed keys into the block summaries may hold at once
    (engine/summary_keeper.py folds a prefill's keys by pieces whose keys of every layer
    fill at most one read chunk in float32, `SummaryKeeper.fold_tokens`): FOLD_COPIES
    pieces. Llama-3.1-8B (32 layers x 8 x 128: 128 KiB a token in float32), 8,192 batched
    tokens, 64 MiB chunks: pieces of 512 tokens, 5 x 64 MiB = 0.34 GB. A selection never
    runs at the same time: the plan reserves the larger of the two."""
    tokens = min(fold_piece_tokens(num_layers, num_kv_heads, head_dim, chunk_bytes),
                 max_batched_tokens)
    return FOLD_COPIES * tokens * num_layers * num_kv_heads * head_dim * FLOAT32_BYTES


def fold_piece_tokens(num_layers: int, num_kv_heads: int, head_dim: int,
                      chunk_bytes: int | None = None) -> int:
    """Tokens the engine folds at once: their keys of every layer fill at most one read
    chunk (`chunk_bytes`, None: SCORE_CHUNK_BYTES) in float32 (at least one token)."""
    return max(1, _read_chunk(chunk_bytes) // (num_layers * num_kv_heads * head_dim
                                               * FLOAT32_BYTES))


def _read_chunk(chunk_bytes: int | None) -> int:
    """What a read chunk of `chunk_bytes` copies at run time (`reads.read_limit`)."""
    most = reads.SCORE_CHUNK_BYTES
    return most if chunk_bytes is None else min(most, chunk_bytes)


# A graph's private pool holds, beside the largest bucket's logits, the activations live
# at once within a layer: an allowance of this many hidden-sized rows per token (the qkv
# projection, the attention's output, the MLP's gate and up projections at up to 3.5x the
# hidden size, the residual), not measured here (no GPU in CI).
ACTIVATION_ROWS = 16
# vLLM's own allowance for one captured graph's overhead (profile_cudagraph_memory,
# vllm/v1/worker/gpu_model_runner.py, 0.32.0)
GRAPH_OVERHEAD_BYTES = 2**20


def round_graph_bytes(bounds, num_layers: int, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, vocab_size: int, element: int, capture_tokens: int,
                      cuda_graphs: bool, draft_bounds=None, window_groups: int = 0,
                      window_width: int = 0) -> int:
    """What `round_graphs` allocates beside the KV cache (engine/device/): the middle
    pass's input buffers at `bounds` (engine/device/bounds.RoundBounds: ids, positions,
    slots, query starts, lengths, per-layer tables [L, R, W], their column numbers), its
    queries' copies (one hidden-sized row per token and layer), the copies of vLLM's
    passes' queries and keys (`capture_tokens` rows per layer, device/capture.
    CaptureBuffers) and, with CUDA graphs,
    their one pool: the largest bucket's logits (float32, the widest they come), its
    activations (ACTIVATION_ROWS) and GRAPH_OVERHEAD_BYTES per graph. `element`: the
    model's bytes per value. Example, Llama-3.1-8B (32 layers, 32 x 128 query heads, 8 KV
    heads, V 128,256, bf16), 15 drafting requests (5 buckets up to 15 tokens), two levels,
    rows of 258 blocks, 512 capture tokens: inputs 0.5 MiB, queries 3.8 MiB, vLLM's copies
    160 MiB, pool 14.2 MiB (logits 7.3, activations 1.9, 5 graphs): 178.4 MiB.
    `draft_bounds` (three levels): the small draft's inputs (one table) and, with CUDA
    graphs, its pool, sized with the target's hidden size (the draft's is smaller).
    `window_groups` (a target with sliding-window layers): each one's table of
    `window_width` blocks a request and its slots, and the true lengths
    (round_graph.PassBuffers)."""
    tokens, requests, width = bounds.max_tokens, bounds.max_requests, bounds.max_width
    hidden = num_q_heads * head_dim
    # ids int32, positions and slots int64; query starts and lengths; tables; columns int64
    inputs = (tokens * (4 + 8 + 8) + (2 * requests + 1) * 4 + num_layers * requests * width * 4
              + width * 8)
    if window_groups:  # tables [R, W_g] int32, slots [T] int64 a group; true lengths [R]
        inputs += window_groups * (requests * window_width * 4 + tokens * 8) + requests * 4
    queries = num_layers * tokens * hidden * element
    step_copies = num_layers * capture_tokens * (num_q_heads + num_kv_heads) * head_dim * element
    pool = _pool_bytes(bounds, tokens, hidden, vocab_size, element) if cuda_graphs else 0
    draft = 0
    if draft_bounds is not None:
        d_tokens, d_reqs = draft_bounds.max_tokens, draft_bounds.max_requests
        draft = (d_tokens * (4 + 8 + 8) + (2 * d_reqs + 1) * 4
                 + d_reqs * draft_bounds.max_width * 4 + draft_bounds.max_width * 8)
        if cuda_graphs:
            draft += _pool_bytes(draft_bounds, d_reqs, hidden, vocab_size, element)
    return inputs + queries + step_copies + pool + draft


# `selection_graphs`' staged host values (engine/device/selection_graph.py): per token [T]
# fields, then per request [R] fields, then the query starts [R + 1], in this order.
SELECTION_TOKEN_FIELDS = ("positions", "owner", "valid", "picked", "tokens")
SELECTION_REQUEST_FIELDS = ("query_rows", "num_selected", "tail_start", "num_tails",
                            "seq_lens", "refresh_rows")


def selection_staged_length(tokens: int, reqs: int) -> int:
    """int64 values a selection graph's staged array holds (engine/device/selection_graph:
    `SELECTION_TOKEN_FIELDS` per token, `SELECTION_REQUEST_FIELDS` per request, then the
    query starts) at `tokens` tokens and `reqs` requests."""
    return (len(SELECTION_TOKEN_FIELDS) * tokens + len(SELECTION_REQUEST_FIELDS) * reqs
            + reqs + 1)


def selection_graph_bytes(bounds, num_layers: int, listed: int, sinks: int, max_blocks: int,
                          max_selected: int, cuda_graphs: bool) -> int:
    """What `selection_graphs` allocates beside `round_graphs` (engine/device/
    selection_graph.SelectionGraphs) at `bounds` (R requests, T tokens): the listed
    buffers [R, L, listed] (logical blocks and summary rows int64, counts float32, padding
    bool), the frame's [R, 1 + sinks] int64, the rows' block tables [R, max_blocks] int32,
    the selection [R, L, max_selected] int32 and the staged values (the pass's tokens
    among them) int64; with CUDA graphs their pool, which holds the re-ranking's and the
    layout's results (a selection and a table row [R, L, max_selected + width] each,
    int64) and GRAPH_OVERHEAD_BYTES a graph, two a bucket (with the re-ranking and
    without). Example, the Llama-3.1-8B plan at 53,000 blocks (32 layers; 15 drafting
    requests and tokens, 5 buckets; lists of 1,000 blocks, 4 x 250 retrieved; 1 sink;
    8,192 blocks a request; 252 selected; rows of 258): lists 9.6 MiB, tables 0.47 MiB,
    selections 0.46 MiB; with CUDA graphs a pool of 1.9 MiB and 10 graphs: 22.4 MiB in
    all."""
    reqs, tokens = bounds.max_requests, bounds.max_tokens
    lists = reqs * num_layers * listed * (8 + 8 + 4 + 1)
    frame = reqs * (1 + sinks) * 8
    tables = reqs * max_blocks * 4
    selected = reqs * num_layers * max_selected * 4
    staged = selection_staged_length(tokens, reqs) * 8
    pool = 0
    if cuda_graphs:  # two graphs a bucket: with the re-ranking and without
        pool = (reqs * num_layers * (max_selected + bounds.max_width) * 8
                + 2 * len(bounds.buckets) * GRAPH_OVERHEAD_BYTES)
    return lists + frame + tables + selected + staged + pool


def _pool_bytes(bounds, logit_rows: int, hidden: int, vocab_size: int, element: int) -> int:
    """A level's graph pool: `logit_rows` rows of float32 logits, the largest bucket's
    activations (ACTIVATION_ROWS per token) and GRAPH_OVERHEAD_BYTES per graph."""
    return (logit_rows * vocab_size * FLOAT32_BYTES
            + bounds.max_tokens * hidden * ACTIVATION_ROWS * element
            + len(bounds.buckets) * GRAPH_OVERHEAD_BYTES)
