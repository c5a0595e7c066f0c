"""What TriForce allocates stays within what engine/memory.py reserved, and what it reserves
stays in proportion to the KV cache it serves.

A tiny target with a 152,064-token vocabulary (Qwen2.5's), gamma2 = 6, top-p sampling, two
and three levels (and 24 requests of three levels over a 16,384-token vocabulary, past one
chunk of the middle round's vocabulary work): torch's memory profiler records every
allocation of a few `propose` calls on CPU; the peak of what each call allocated (and held at once) plus the preallocated
probability buffer must fit the fixed part the engine reserved (`Sizing.fixed_bytes`, from
`vocabulary_rows`). The model's forwards inside `propose` count too: on a GPU their logits
are TriForce's as well. The selection, the fold and the lazy reads are profiled against
their bounds, with SCORE_CHUNK_BYTES cut and with the engine's own smaller read chunk
(`BlockSummaries.chunk_bytes`). The bounds by the cache's size are worked by hand, a
384 MiB SmolLM2 engine starts, drafts, and reserves at most a tenth of its budget, and at
Llama-3.1-8B's shape (computed, not allocated) the default coded summaries keep at least 96%
of the KV blocks plain vLLM makes of the same memory, as the start-up line says.
"""

import dataclasses
import types

import numpy as np
import pytest
import tiny_models
from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

VOCAB = 152_064
BATCH = 4
MID_VOCAB = 16_384
CHUNKED_BATCH = 24
PROFILED_CALLS = (2, 3)  # decode steps (call 1 is the prefill)
PROFILED_KV_BYTES = 3 * 2**30


def peak_bytes(fn):
    """(fn(), the peak of bytes allocated inside fn and alive at once), from torch's memory
    profiler (`torch.profiler.profile(profile_memory=True)`; its timeline is a private API
    of torch 2.13, read here only): memory allocated before fn and freed in it is not
    credited back, so the peak is never underestimated."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        out = fn()
    live = peak = 0
    created = set()
    for _, action, (key, _version), size in MemoryProfileTimeline(prof._memory_profile()).timeline:
        if action == Action.CREATE:
            created.add(key)
            live += size
        elif action == Action.DESTROY and key in created:
            live -= size
        peak = max(peak, live)
    return out, peak


def tiny_target_and_draft(path, vocab_size: int):
    return (tiny_models.build_tiny_llama(path / "target", num_layers=2, hidden=64, heads=2,
                                         kv_heads=2, vocab_size=vocab_size),
            tiny_models.build_tiny_llama_draft(path / "draft", vocab_size=vocab_size))


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    return tiny_target_and_draft(tmp_path_factory.mktemp("big_vocab"), VOCAB)


@pytest.fixture(scope="module")
def mid_vocab(tmp_path_factory):
    """A smaller vocabulary, so that the rows of a batch past one chunk of the middle
    round's vocabulary work fit a sixteenth of the profiled cache."""
    return tiny_target_and_draft(tmp_path_factory.mktemp("mid_vocab"), MID_VOCAB)


@pytest.mark.parametrize("levels,batch", [(2, BATCH), (3, BATCH), (3, CHUNKED_BATCH)])
def test_propose_peak_fits_the_reserved_memory(levels, batch, request, monkeypatch):
    """`CHUNKED_BATCH` requests of three levels (gamma1 2): more than one chunk of 21
    requests (engine/buffers.py `middle_chunk_requests`), so the fixed part covers the
    chunks' temporaries and each request's own rows."""
    from vllm import SamplingParams

    target, draft = request.getfixturevalue("big_vocab" if batch == BATCH else "mid_vocab")
    vocab = VOCAB if batch == BATCH else MID_VOCAB
    spec = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 160,
            "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32, "adaptive": False}
    if levels == 3:
        spec.update(model=str(draft), draft_window_tokens=96, draft_tokens_per_round=2)
    # a cache whose sixteenth holds the rows of all the requests (three levels: 160 MB);
    # vLLM's CPU platform would take VLLM_CPU_KVCACHE_SPACE instead
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    # the chunked batch's prompts prefill in one step, so the profiled calls decode
    batched = {} if batch == BATCH else {"max_num_batched_tokens": 16384}
    llm = in_process_llm(target, spec,
                         **make_engine_kwargs(max_num_seqs=batch, max_model_len=2048,
                                              kv_cache_memory_bytes=PROFILED_KV_BYTES,
                                              **batched))
    try:
        drafter = drafter_of(llm)
        original, calls, peaks = drafter.propose, [0], []

        def profiled(*args, **kwargs):
            calls[0] += 1
            if calls[0] not in PROFILED_CALLS:
                return original(*args, **kwargs)
            out, peak = peak_bytes(lambda: original(*args, **kwargs))
            peaks.append(peak)
            return out

        drafter.propose = profiled
        prompts = [tiny_models.make_text(300, seed=i) for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4,
                                             ignore_eos=True), use_tqdm=False)
        stats = drafter.stats.snapshot()
        sizing, buffer = drafter.sizing, drafter._probs_buffer
    finally:
        free_llm(llm)
    assert_drafted(stats, levels)
    row = vocab * 4
    print(f"\n{levels} levels, {batch} requests: propose peaks "
          f"{[round(p / row, 1) for p in peaks]} vocabulary rows + buffer "
          f"{buffer.nbytes / row:.0f}; reserved {sizing.fixed_bytes / row:.0f}")
    assert sizing.drafting == batch == buffer.rows.shape[0]  # every request drafted at once
    assert len(peaks) == len(PROFILED_CALLS) and min(peaks) > 0
    assert buffer.nbytes + max(peaks) <= sizing.fixed_bytes


# How a test cuts the read chunk: the global cap, or the engine's own (what the memory plan
# sizes for a small cache and the proposer hands its summaries)
CHUNK_LIMITS = ("SCORE_CHUNK_BYTES", "BlockSummaries.chunk_bytes")


def limit_reads(monkeypatch, limited_by: str, chunk_bytes: int) -> dict:
    """Cut the read chunk to `chunk_bytes` as `limited_by` says; returns the BlockSummaries
    keyword arguments that do it (none for the global cap)."""
    from vllm_triforce.core import reads

    if limited_by == "SCORE_CHUNK_BYTES":
        monkeypatch.setattr(reads, "SCORE_CHUNK_BYTES", chunk_bytes)
        return {}
    return {"chunk_bytes": chunk_bytes}


@pytest.mark.parametrize("limited_by", CHUNK_LIMITS)
@pytest.mark.parametrize("coded", [False, True], ids=["float", "coded"])
@pytest.mark.parametrize("strategy,chunk_kib", [("gather", 256), ("all", 256),
                                                ("gather", 4096)])
def test_selection_scratch_fits_its_reservation(monkeypatch, strategy, chunk_kib, coded,
                                                limited_by):
    """A step-start selection (every candidate scored, the shortlist kept) and a middle
    re-ranking hold at most `selection_scratch_bytes` at once: profiled on CPU with a small
    read chunk, so the chunked reads are chunked here too (8 requests, 4 layers,
    96-block tables; no stacked queries: `choose` takes them gathered). With 4 MiB chunks
    the re-ranking keeps a copy of the listed summaries (2.6 MiB, `listed_copy`), alive
    after the call: counted in the middle's peak. The engine's own chunk
    (`BlockSummaries.chunk_bytes`) bounds the reads as the global cap does. Coded summaries
    (the default) are read back in place: no copy larger than a chunk's float32 values."""
    import torch

    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import Selector
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.config import BlockCounts
    from vllm_triforce.engine import buffers

    limit = limit_reads(monkeypatch, limited_by, chunk_kib * 2**10)
    monkeypatch.setattr(buffers, "STACKED_QUERIES_BYTES", 0)
    reqs, layers, heads, dim, q_heads, bs, width = 8, 4, 2, 64, 4, 16, 96
    gen = torch.Generator().manual_seed(0)
    summaries = BlockSummaries(layers, reqs * width, heads, dim, bs, keep_variance=True,
                               coded=coded, **limit)
    shape = (layers, reqs * width, heads, dim)
    sums, deviations = torch.randn(shape, generator=gen), torch.rand(shape, generator=gen)
    if coded:
        summaries.sums.fill_(sums)
        summaries.square_deviations.fill_(deviations)
    else:
        summaries.sums.copy_(sums)
        summaries.square_deviations.copy_(deviations)
    summaries.counts.fill_(bs)
    table = torch.randperm(reqs * width, generator=gen).view(reqs, width)
    committed = torch.full((reqs,), width * bs - 5)
    selector = Selector(make_policy("retrieval", variance=True, strategy=strategy),
                        BlockCounts(block_size=bs, budget_blocks=24, retrieval_sink_blocks=1,
                                    retrieval_recent_blocks=2), shortlist_factor=4)
    query = torch.randn(reqs, layers, q_heads, dim, generator=gen)
    choice, at_start = peak_bytes(lambda: selector.choose(query, summaries, table, committed,
                                                          keep_shortlist=True))
    _, in_middle = peak_bytes(lambda: selector.choose(query, summaries, table, committed,
                                                      shortlist=choice.shortlist))
    assert (choice.shortlist.copy is not None) == (chunk_kib == 4096)
    bound = buffers.selection_scratch_bytes(reqs, layers, width, heads, dim, q_heads,
                                           chunk_bytes=chunk_kib * 2**10,
                                           num_blocks=reqs * width)
    print(f"\n{strategy}: peaks {at_start} (step start), {in_middle} (middle); bound {bound}")
    assert max(at_start, in_middle) <= bound
    assert at_start > bound // 4  # the bound is of the right size, not a blanket


@pytest.mark.parametrize("limited_by", CHUNK_LIMITS)
@pytest.mark.parametrize("dtype,variance", [("float32", "channels"), ("bfloat16", "channels"),
                                            ("bfloat16", "bands"), ("bfloat16", "coded")])
def test_fold_scratch_fits_its_reservation(monkeypatch, dtype, variance, limited_by):
    """Folding a prefill pass's keys into the summaries (engine/summary_keeper.py, by
    pieces of one read chunk of float32 keys) holds at most `fold_scratch_bytes` at once:
    profiled on CPU with the read chunk cut to 64 KiB, by SCORE_CHUNK_BYTES or by the
    summaries' own `chunk_bytes` (2 requests' prompt chunks of 700 and 333 tokens, the
    second starting inside a block; 4 layers of 2 x 64 keys, key variance, per channel,
    per band or coded, and bounds). Folded whole, the same pass would not fit; by pieces it
    ends with the same summaries (coded: within one more rounding of a block that two
    pieces share)."""
    from types import SimpleNamespace

    import torch

    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.engine import buffers
    from vllm_triforce.engine.summary_keeper import SummaryKeeper, fold_committed

    layers, heads, dim, bs, lens, starts = 4, 2, 64, 16, (700, 333), (0, 50)
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(sum(lens), heads * dim, generator=gen).to(getattr(torch, dtype))
            for _ in range(layers)]
    width = 64
    batch = SimpleNamespace(
        verify_start=list(starts), q_lens=list(lens), num_rejected=[0, 0],
        query_start_loc=[0, lens[0], sum(lens)],
        block_table=torch.randperm(2 * width, generator=gen).view(2, width).int())

    def fold(chunk_bytes):
        limit = limit_reads(monkeypatch, limited_by, chunk_bytes)
        level = SummaryKeeper.__new__(SummaryKeeper)  # its fold, without a capture
        level.block_size = bs
        level.device = torch.device("cpu")
        level.summaries = BlockSummaries(layers, 2 * width, heads, dim, bs,
                                         dtype=getattr(torch, dtype), keep_bounds=True,
                                         keep_variance=True,
                                         compact_variance=variance == "bands",
                                         coded=variance == "coded", **limit)

        def run():
            for committed in level.committed_tokens(batch, [0, 1]):
                fold_committed(level.summaries, keys, committed)

        return level, peak_bytes(run)[1]

    level, peak = fold(64 * 2**10)
    assert level.fold_tokens() == 32
    bound = buffers.fold_scratch_bytes(sum(lens), layers, heads, dim, chunk_bytes=64 * 2**10)
    whole, whole_peak = fold(2**40)
    print(f"\n{dtype}: peak {peak} by pieces, {whole_peak} whole; bound {bound}")
    assert bound // 4 < peak <= bound < whole_peak
    for store in ("sums", "square_deviations", "mins", "maxs"):
        pieces, one = (values(getattr(s.summaries, store)) for s in (level, whole))
        if variance == "coded" and store in ("sums", "square_deviations"):
            # a block two pieces share is coded twice: within two roundings of its row's top
            top = one.abs().amax(-1, keepdim=True)
            assert ((pieces - one).abs() <= top / 8).all(), store
            assert (pieces - one).abs().mean() < 1e-2 * top.mean(), store
        else:
            assert torch.allclose(pieces, one, rtol=1e-2, atol=1e-2), store
    assert torch.equal(level.summaries.counts, whole.summaries.counts)


def values(store):
    """A summary store as float32 values (a coded one read back)."""
    from vllm_triforce.core.summary_coding import CodedStore

    return store.blocks(slice(None)) if isinstance(store, CodedStore) else store.float()


# ---- the fixed part follows the cache it serves (engine/memory.py) -----------------------
SMALL_CACHE = 384 * 2**20


def smollm2_plan(max_num_seqs=256, kv_bytes_per_block=1_474_560, backend=None):
    """engine/memory.py's small-cache example: SmolLM2-135M float32 (30 layers x 3 KV heads
    x 64, 9 query heads, V 49,152), block 32, key variance in float summaries
    (`compact_summaries` false), vLLM's CPU `LLM` defaults
    (256 sequences, the shape's drafting cap before the cache bounds it; 4,096 batched
    tokens), max_model_len 4,096, gamma2 4, two levels: an EngineShape from these sizes."""
    from vllm_triforce.config import TriForceConfig
    from vllm_triforce.engine.shape import EngineShape

    shape = EngineShape.from_sizes(
        num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49_152, block_size=32,
        max_num_seqs=max_num_seqs,
        cfg=TriForceConfig(num_speculative_tokens=4, compact_summaries=False),
        max_model_len=4096, max_batched_tokens=4096, num_q_heads=9)
    return shape.memory_plan(kv_bytes_per_block, backend)


def test_a_small_cache_keeps_a_small_share_worked_example():
    """The docstring's numbers: 252 blocks, reads of 1/256 of their KV (63 tokens' keys),
    the fold's five pieces the largest scratch, two of the 256 sequences drafting at once (a
    third's rows would pass 1/16 of the KV), 7.7% of 384 MiB reserved where the unbounded
    plan wanted more than three times the whole budget."""
    plan = smollm2_plan()
    assert plan.blocks_for(SMALL_CACHE) == 252
    sizing = plan.sized(252)
    assert sizing.chunk_bytes == 371_589_120 // 256 == 1_451_520 == 63 * 23_040
    assert sizing.scratch_bytes == 5 * 1_451_520 == 7_257_600
    assert sizing.drafting == 2
    # per request 4 hand-off rows + 1 of logits; 1 spare row; a chunk of 2: 3 x 2 + 8 x 2
    assert sizing.probability_bytes == (2 * (4 + 1) + 1 + 3 * 2 + 8 * 2 + 13 * 2) * 49_152 \
        * 4 == 11_599_872
    assert sizing.scaled_bytes == 18_857_472 <= 371_589_120 // 16 == 23_224_320
    assert plan._sized(3, sizing.chunk_bytes, 252).scaled_bytes == 24_559_104
    assert plan.footprint(252) == 252 * 1_520_644 + 18_857_472 == 402_059_760 <= SMALL_CACHE
    assert plan.footprint(253) > SMALL_CACHE
    reserved = SMALL_CACHE - plan.kv_budget(SMALL_CACHE)
    assert reserved == 31_064_064 and reserved <= SMALL_CACHE // 10
    assert plan.fixed_bytes > 3 * SMALL_CACHE  # 256 requests, 64 MiB reads: 1,286 MiB


def test_the_read_chunk_is_a_16th_of_the_limit_between_one_block_and_64_mib():
    """A read copies at most 1/16 of what the rows and scratch may take (`scaled_limit`):
    1/256 of a cache under 3.2 GiB, (192 MiB + 1/256 of it) / 16 above."""
    plan = smollm2_plan()
    block_keys = 32 * 30 * 3 * 64 * 4  # 737,280 B: what a lazy read copies at the least
    assert plan.chunk_bytes(256 * 2**20) == 2**20
    assert plan.chunk_bytes(100 * 2**20) == block_keys  # 400 KiB would hold no block
    assert plan.chunk_bytes(0) == block_keys
    assert plan.chunk_bytes(32 * 2**30) == (192 + 128) * 2**20 // 16 == 20 * 2**20
    assert plan.chunk_bytes(208 * 2**30) == plan.chunk_bytes(None) == 64 * 2**20


def test_the_limit_is_a_16th_of_a_small_cache_and_192_mib_plus_a_256th_of_a_large_one():
    from vllm_triforce.engine.memory import scaled_limit

    mib, gib = 2**20, 2**30
    assert scaled_limit(384 * mib) == 24 * mib
    assert scaled_limit(3 * gib) == 192 * mib  # a 16th: 192 + 12 MiB by the second rule
    assert scaled_limit(4 * gib) == 208 * mib  # 192 + 16 MiB: less than a 16th, 256 MiB
    assert scaled_limit(100 * gib) == 592 * mib
    assert scaled_limit(100 * gib) < 100 * gib // 128


def test_the_drafting_cap_grows_with_the_cache_within_its_limit():
    """From the smallest cache up to one that bounds nothing (past 3.2 GiB the limit grows
    by 1/256 of the cache, the reads by 1/16 of that): the cap never shrinks as the cache
    grows, up to max_num_seqs (256), rows and scratch stay within `scaled_limit` unless one
    request alone passes it, and a larger budget never gives fewer blocks."""
    from vllm_triforce.engine.memory import scaled_limit

    plan = smollm2_plan()
    every = plan.blocks_for_drafting(256)  # what the start-up log names for all to draft
    assert plan.sized(every).drafting == 256 > plan.sized(every - 1).drafting
    sizes = sorted({int(1.15 ** i) for i in range(95)} | set(range(0, 3000, 80))
                   | {every - 1, every, every * 2})  # 0 .. 2,200 blocks (3.2 GiB) .. 395,106
    caps, blocks = [], []
    for num_blocks in sizes:
        sizing = plan.sized(num_blocks)
        kv_bytes = num_blocks * plan.kv_bytes_per_block
        assert sizing.drafting == 1 or sizing.scaled_bytes <= scaled_limit(kv_bytes)
        caps.append(sizing.drafting)
        blocks.append(plan.blocks_for(plan.footprint(num_blocks)))
        assert blocks[-1] >= num_blocks
    assert caps == sorted(caps) and caps[0] == 1 and caps[-1] == 256  # max_num_seqs
    assert blocks == sorted(blocks)


# ---- Llama-3.1-8B's shape: TriForce keeps 96% of plain vLLM's blocks (engine/memory.py) --
KV_8B = 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB: a block of every layer's keys and values, bf16
# what plain vLLM made 55,604 blocks of on an H200 at gpu_memory_utilization 0.9
# (benchmarks/gpu/results.json), and the ~52 GB an 80 GB GPU leaves the cache
H200_AVAILABLE, GPU_80GB_AVAILABLE = 55_604 * KV_8B, 52 * 10**9


SUMMARY_SETTINGS = {"coded": {},  # the default on a GPU: compact_summaries
                    "compact": {"compact_key_variance": True},
                    "float": {"compact_summaries": False}}


def llama_8b_plan(summaries: str = "coded", max_num_seqs: int = 256,
                  round_graphs: bool = False, backend: str | None = None,
                  hands_off_probs: bool = True, selection_graphs: bool = False):
    """engine/memory.py's example at scale: Llama-3.1-8B's shape (32 layers x 8 KV heads x
    128, 32 query heads, V 128,256), bf16 KV cache, block 16, max_model_len 131,072, 8,192
    batched tokens, two levels, gamma2 6; `summaries`: a key of SUMMARY_SETTINGS (the
    default coded ones, the banded `compact_key_variance`, or bf16 sums and float32
    variances). No per-layer builders (FLASH_ATTN, the GPU bench's backend, keeps none)."""
    import torch

    from vllm_triforce.config import TriForceConfig
    from vllm_triforce.engine.shape import EngineShape

    cfg = TriForceConfig(num_speculative_tokens=6, round_graphs=round_graphs,
                         **({"compiled_selection": True, "selection_graphs": True}
                            if selection_graphs else {}), **SUMMARY_SETTINGS[summaries])
    shape = EngineShape.from_sizes(
        num_layers=32, num_kv_heads=8, head_dim=128, vocab_size=128_256, block_size=16,
        max_num_seqs=max_num_seqs, cfg=cfg, max_model_len=131_072, max_batched_tokens=8192,
        num_q_heads=32, summary_dtype=torch.bfloat16)
    shape = dataclasses.replace(shape, hands_off_probs=hands_off_probs)
    return shape.memory_plan(KV_8B, backend=backend)


def test_model_runner_v2_reserves_no_hand_off_rows():
    """Model Runner V2's verifier reads the middle level's logits from its own buffer
    (engine/mrv2/draft_logits.py), so its TriForce host keeps no [drafting, gamma2, V]
    float32 probability rows: at the 8B shape that is 6 rows of 128,256 floats per drafting
    request, and their spare row, fewer in the plan: within the same share of the cache,
    more requests may draft at once (17 against 15 at 53,000 blocks), and it still keeps
    96% of plain vLLM's blocks on an H200; the buffer it allocates is empty."""
    from vllm_triforce.engine.buffers import vocabulary_rows
    from vllm_triforce.engine.middle import HandOffBuffer, MiddleDrafts, hand_off

    assert vocabulary_rows(15, 6, 0) - vocabulary_rows(15, 6, 0, hand_off=False) == 15 * 6 + 1
    v1, v2 = llama_8b_plan().sized(53_000), llama_8b_plan(hands_off_probs=False).sized(53_000)
    assert (v1.drafting, v2.drafting) == (15, 17)
    assert v2.probability_bytes == vocabulary_rows(17, 6, 0, hand_off=False) * 128_256 * 4
    # the share stays what bounds the fixed part: the same KV kept, within the drafting
    # scratch of the two more requests
    assert llama_8b_plan(hands_off_probs=False).blocks_for(H200_AVAILABLE) >= 0.96 * 55_604
    empty = HandOffBuffer(0, 6, 32)
    assert empty.nbytes == 0 and empty.rows is None
    batch = types.SimpleNamespace(num_reqs=1, req_ids=["a"], all_greedy=lambda rows: False)
    drafts = MiddleDrafts([0], [2], np.array([5]), np.array([9]), width=6)
    drafts.tokens[0, :2] = [3, 4]
    assert hand_off(batch, drafts, [2], empty) == ([[3, 4]], None, None)


def test_selection_graphs_reserve_their_buffers_and_pool():
    """`selection_graphs` reserves buffers.selection_graph_bytes beside the round graphs'
    (the worked example there: 22.4 MiB at the H200 example's 15 drafting requests), and
    the 8B plan still keeps 96% of plain vLLM's blocks."""
    from vllm_triforce.engine.buffers import selection_graph_bytes

    graphs = llama_8b_plan(round_graphs=True, backend="FLASH_ATTN").sized(53_000)
    plan = llama_8b_plan(round_graphs=True, backend="FLASH_ATTN", selection_graphs=True)
    fused = plan.sized(53_000)
    assert fused.drafting == graphs.drafting == 15
    mib = 2**20
    lists = 15 * 32 * 1000 * (8 + 8 + 4 + 1)  # 4 x 250 retrieved blocks a layer
    pool = 15 * 32 * (252 + 258) * 8 + 10 * mib  # two graphs a bucket
    assert fused.round_bytes - graphs.round_bytes == selection_graph_bytes(
        plan.shape.round_bounds(15), 32, 1000, 1, 8192, 252, True)
    assert fused.round_bytes - graphs.round_bytes > lists + pool
    assert round((fused.round_bytes - graphs.round_bytes) / mib, 1) == 22.4
    assert plan.blocks_for(H200_AVAILABLE) >= 0.96 * 55_604


def test_round_graphs_reserve_their_buffers_and_on_flash_attn_their_pool():
    """`round_graphs` reserves buffers.round_graph_bytes (the worked example there: 15
    drafting requests at the H200 example), the pool only where the passes are CUDA graphs
    (FLASH_ATTN), and the start-up line names it; with compact summaries the 8B plan still
    keeps 96% of plain vLLM's blocks."""
    from vllm_triforce.engine.memory import describe_reservation

    off = llama_8b_plan().sized(53_000)
    eager = llama_8b_plan(round_graphs=True).sized(53_000)
    graphs = llama_8b_plan(round_graphs=True, backend="FLASH_ATTN")
    sized = graphs.sized(53_000)
    assert off.round_bytes == 0 and off.drafting == eager.drafting == sized.drafting == 15
    mib = 2**20
    inputs = 15 * (4 + 8 + 8) + 31 * 4 + 32 * 15 * 258 * 4 + 258 * 8  # columns: 258 int64
    assert eager.round_bytes == inputs + 32 * 15 * 4096 * 2 + 32 * 512 * 40 * 128 * 2
    pool = 15 * 128_256 * 4 + 15 * 4096 * 16 * 2 + 5 * mib
    assert sized.round_bytes == eager.round_bytes + pool
    assert round(sized.round_bytes / mib, 1) == 178.4
    assert sized.fixed_bytes == off.fixed_bytes + sized.round_bytes
    blocks = graphs.blocks_for(H200_AVAILABLE)
    assert blocks >= 0.96 * 55_604
    line = describe_reservation(graphs, H200_AVAILABLE, blocks)
    assert "round graphs' buffers and pool 178.4 MiB" in line


def test_coded_summaries_cost_a_31st_of_the_kv_at_llama_8b_shape():
    """Per 2 MiB block: coded (the default), the key sums and the key variance each one byte
    a value, 32 x 8 x 128, and a float32 scale per layer and KV head (1/31 of the block in
    all, with the count); float, bf16 key sums and a count (1/32 of the block) and the key
    variance in 32 x 8 x 128 float32s (3/32 in all); compact, the variance in 32 x 8 x 8
    bands in bf16 (17/512)."""
    from vllm_triforce.engine.memory import summary_parts

    coded, compact, floats = (llama_8b_plan(kind) for kind in ("coded", "compact", "float"))
    assert summary_parts(coded.shape) == {"mean keys": 32_768 + 1_024 + 4,
                                          "key variance": 32_768 + 1_024}
    assert summary_parts(floats.shape) == {"mean keys": 65_536 + 4, "key variance": 131_072}
    assert summary_parts(compact.shape) == {"mean keys": 65_536 + 4, "key variance": 4_096}
    assert coded.summary_bytes_per_block == 67_588 < KV_8B // 31
    assert floats.summary_bytes_per_block == 196_612 == 3 * KV_8B // 32 + 4
    assert compact.summary_bytes_per_block == 69_636 == 17 * KV_8B // 512 + 4


@pytest.mark.parametrize("available,plain,coded_blocks,compact_blocks,float_blocks,drafting", [
    (H200_AVAILABLE, 55_604, 53_584, 53_533, 50_574, 15),
    (GPU_80GB_AVAILABLE, 24_795, 23_839, 23_816, 22_511, 11)])
def test_llama_8b_keeps_96_percent_of_plain_vllms_blocks_by_default(
        available, plain, coded_blocks, compact_blocks, float_blocks, drafting):
    """engine/memory.py's example at scale, computed, not allocated: with the default coded
    summaries (and with the banded `compact_key_variance`) the plan keeps at least 96% of
    the blocks plain vLLM makes of the same memory at vLLM's default gpu_memory_utilization,
    on an H200 and on an 80 GB GPU, whatever max_num_seqs (the limit on rows and scratch,
    not vLLM's 1,024 sequences, caps the drafting requests); bf16 sums and float32
    variances (`compact_summaries: false`) keep 91%."""
    from vllm_triforce.engine.memory import scaled_limit

    assert available // KV_8B == plain
    coded, compact, floats = (llama_8b_plan(kind) for kind in ("coded", "compact", "float"))
    assert coded.blocks_for(available) == coded_blocks >= 0.96 * plain
    assert compact.blocks_for(available) == compact_blocks >= 0.96 * plain
    assert floats.blocks_for(available) == float_blocks < 0.92 * plain
    sizing = coded.sized(coded_blocks)
    assert sizing.drafting == drafting
    assert sizing.fixed_bytes <= scaled_limit(coded_blocks * KV_8B)
    assert llama_8b_plan(max_num_seqs=1024).blocks_for(available) == coded_blocks


def test_the_start_up_line_gives_the_blocks_against_plain_vllm_and_each_buffer():
    """`describe_reservation` (the proposer's start-up log) at the H200 example: the blocks
    kept against plain vLLM's, the reservation and each of its buffers, the summaries store
    by store, the drafting cap and what would lift it."""
    from vllm_triforce.engine.memory import describe_reservation

    plan = llama_8b_plan()
    line = describe_reservation(plan, H200_AVAILABLE, plan.blocks_for(H200_AVAILABLE))
    for part in ("the KV cache gets 53584 blocks, 96.4% of the 55604 plain vLLM would make "
                 "of 111208.0 MiB; reserved 4040.0 MiB (3.6%)",
                 "block summaries 3453.9 MiB (mean keys 1727.0 MiB, key variance 1726.8 MiB)",
                 "probability rows 228.0 MiB (15 drafting requests)", "scratch 357.1 MiB",
                 "remainder 1.0 MiB", "15 of max_num_seqs 256 requests may draft at once",
                 "at most 610.6 MiB beside this KV cache",
                 "a KV cache of 1030524.0 MiB would let all 256 draft",
                 "reads of at most 38.2 MiB"):
        assert part in line, part


def test_selection_scratch_is_no_wider_than_the_cache():
    """4 drafting requests, 2 layers x 2 KV heads x 8, 4 query heads, tables of up to 100
    blocks in a cache of 40, reads of 1 KiB: 6 score copies of 40 blocks and the "all"
    strategy's dots over the 40-block store (40 x 4 requests x 2 layers x 4 B each), 3
    reads of 1 KiB, the stacked queries (one read: 1 KiB), 3 copies of the queries
    (4 x 2 x 4 x 8 x 4 B each). Unbounded (tables of 100, a store of up to 2 x 4 x 100
    blocks, 64 MiB reads, 32 MiB of stacked queries) it is 2,000 times that."""
    from vllm_triforce.engine.buffers import (fold_scratch_bytes, lazy_read_bytes,
                                              selection_scratch_bytes)

    bounded = selection_scratch_bytes(4, 2, 100, 2, 8, 4, chunk_bytes=1024, num_blocks=40)
    assert bounded == (6 * 40 + 40) * 4 * 2 * 4 + 3 * 1024 + 1024 + 3 * 4 * 2 * 4 * 8 * 4
    assert bounded == 16_128
    unbounded = selection_scratch_bytes(4, 2, 100, 2, 8, 4)
    assert unbounded == ((6 * 100 + 800) * 4 * 2 * 4 + 3 * (4 * 100 * 2 * 2 * 8 * 4)
                         + 32 * 2**20 + 3 * 4 * 2 * 4 * 8 * 4) > 2000 * bounded
    # a block of keys (2 x 2 x 4 tokens x 8 x 4 B = 512 B) is read whole, whatever the chunk
    assert lazy_read_bytes(10, 2, 2, 8, 4, chunk_bytes=1000) == 3 * 512
    assert lazy_read_bytes(10, 2, 2, 8, 4, chunk_bytes=100) == 3 * 512
    assert lazy_read_bytes(1, 2, 2, 8, 4) == 3 * 512  # no more than the blocks read
    # fold pieces of 1000 // 128 = 7 tokens (128 B: one token's keys of both layers)
    assert fold_scratch_bytes(4096, 2, 2, 8, chunk_bytes=1000) == 5 * 7 * 128


def test_a_budget_without_room_for_one_request_is_refused_naming_each_part():
    """190 MiB hold the 128 blocks of one 4,096-token request for plain vLLM (135 fit),
    not after TriForce's reservation: one TriForce error names the parts and the fix, and
    the size it names is enough."""
    from vllm_triforce.config import TriForceConfigError
    from vllm_triforce.engine.memory import KVBudgetError, check_one_request

    plan, budget, needed = smollm2_plan(), 190 * 2**20, 128 * 1_474_560
    assert budget // plan.kv_bytes_per_block >= 128  # vLLM alone would start
    num_blocks = plan.blocks_for(budget)
    assert num_blocks < 128
    with pytest.raises(KVBudgetError) as refused:
        check_one_request(plan, budget, num_blocks, needed, max_model_len=4096)
    message = str(refused.value)
    assert isinstance(refused.value, TriForceConfigError)
    for part in ("block summaries", "probability rows", "scratch", "kv_cache_memory_bytes",
                 "gpu_memory_utilization", f"max_model_len to at most {num_blocks * 32}"):
        assert part in message, part
    wanted = plan.available_for(needed)
    assert f"kv_cache_memory_bytes={wanted}" in message
    assert plan.kv_budget(wanted) >= needed
    check_one_request(plan, wanted, plan.blocks_for(wanted), needed, max_model_len=4096)


def test_the_384_mib_smollm2_engine_starts_drafts_and_reserves_at_most_a_tenth(smollm2,
                                                                              monkeypatch):
    """The engine of engine/memory.py's small-cache example (fixed depth, so it drafts at
    every step; float summaries, as the example's) starts, reserves what the plan says (at
    most 10% of the budget), sizes its hand-off buffer, read chunk and drafting cap by the
    same `Sizing`, and drafts."""
    from vllm import SamplingParams

    from vllm_triforce.assets import moby_dick_text

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # vLLM's CPU platform would take it instead

    spec = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 512,
            "adaptive": False, "compact_summaries": False}
    llm = in_process_llm(smollm2, spec, **make_engine_kwargs(max_model_len=4096,
                                                             kv_cache_memory_bytes=SMALL_CACHE))
    try:
        drafter = drafter_of(llm)
        out = llm.generate([moby_dick_text()[:6000]],
                           SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        stats, plan, sizing = drafter.stats.snapshot(), drafter.memory_plan(), drafter.sizing
        facts = (drafter.reserved_bytes, drafter.summaries.num_blocks,
                 drafter.summaries.chunk_bytes, drafter._probs_buffer.rows.shape[0],
                 drafter.depth.max_drafting)
    finally:
        free_llm(llm)
    reserved, num_blocks, chunk_bytes, buffer_rows, cap = facts
    print(f"\n384 MiB: reserved {reserved / 2**20:.1f} MiB ({100 * reserved / SMALL_CACHE:.1f}%),"
          f" {num_blocks} blocks, {sizing.drafting} drafting, {stats['top_proposed']} drafts")
    example = smollm2_plan()  # the engine plans what the worked example does
    assert (plan.kv_bytes_per_block, plan.summary_bytes_per_block, plan.sized(num_blocks)) \
        == (example.kv_bytes_per_block, example.summary_bytes_per_block,
            example.sized(num_blocks))
    assert reserved == SMALL_CACHE - plan.kv_budget(SMALL_CACHE) <= SMALL_CACHE // 10
    assert num_blocks == plan.blocks_for(SMALL_CACHE) >= 128
    assert sizing == plan.sized(num_blocks)
    assert (chunk_bytes, buffer_rows, cap) == (sizing.chunk_bytes,) + (sizing.drafting,) * 2
    assert len(out[0].outputs[0].token_ids) == 24
    assert_drafted(stats)


def test_a_budget_that_holds_no_request_after_the_reservation_gets_triforces_error(smollm2,
                                                                                   monkeypatch):
    """190 MiB (plain vLLM starts: 135 blocks for a 128-block request) get TriForce's own
    error before vLLM's generic one."""
    from vllm_triforce.engine.memory import KVBudgetError

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # vLLM's CPU platform would take it instead
    spec = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 512}
    with pytest.raises(KVBudgetError, match="cannot hold one request of max_model_len 4096"):
        in_process_llm(smollm2, spec, **make_engine_kwargs(max_model_len=4096,
                                                           kv_cache_memory_bytes=190 * 2**20))


# ---- the CPU KV sizing and the worker's reservation: one plan ---------------------------
AGREEMENT_SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
                  "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32}


def enable_cpu_flex(monkeypatch) -> None:
    """FLEX_ATTENTION on this CPU through the gated test patch (as tests/test_flex_backend.py:
    the wrapper defers to vLLM unless FLEX is asked for, so it may stay applied)."""
    import cpu_flex
    from vllm_triforce.patches import _util

    monkeypatch.setenv(cpu_flex.ENV, "1")
    _util.check_version()
    cpu_flex.apply()


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLEX_ATTENTION", "FLASHINFER"])
def test_the_cpu_kv_sizing_and_the_workers_reservation_agree(tiny_llama, monkeypatch,
                                                             backend):
    """With no KV size given, the plugin sizes the CPU KV cache from the config
    (patches/cpu_defaults.py), adding what TriForce will reserve; the worker reserves by
    the same plan (a stateful backend's per-layer builders included on both sides), so the
    KV left holds the size the plugin chose, and what was reserved is the rest. CPU_ATTN
    and FLEX_ATTENTION run an engine; FLASHINFER does not run on a CPU, so its worker side
    is `TriForceProposer.memory_plan` over vLLM's KV-cache specs of the model's layers."""
    from vllm_triforce.patches import cpu_defaults

    monkeypatch.delenv(cpu_defaults.KV_ENV, raising=False)
    if backend == "FLASHINFER":
        config, worker = flashinfer_worker_plan(tiny_llama)
        given, engine = config.cache_config.kv_cache_memory_bytes, None
    else:
        config, worker, given, engine = engine_worker_plan(tiny_llama, monkeypatch, backend)
    per_token = cpu_defaults.kv_bytes_per_token(config)
    assert (worker.builder_bytes > 0) == (backend != "CPU_ATTN")
    chosen, bound = cpu_defaults.kv_cache_bytes(per_token, 1024, 2, free_bytes=2**40,
                                                block_size=32)
    assert bound == "demand" and given == worker.available_for(chosen)
    if engine is not None:
        num_blocks, reserved = engine
        assert num_blocks * worker.kv_bytes_per_block >= chosen
        assert reserved == given - num_blocks * worker.kv_bytes_per_block


def engine_worker_plan(tiny_llama, monkeypatch, backend: str):
    """(config, the worker's plan, the KV size the CPU sizing gave, (KV blocks, reserved
    bytes)) of an engine on `backend`."""
    if backend == "FLEX_ATTENTION":
        enable_cpu_flex(monkeypatch)
    llm = in_process_llm(tiny_llama, dict(AGREEMENT_SPEC), attention_config={"backend": backend},
                         **make_engine_kwargs(max_num_seqs=2))
    try:
        config, drafter = llm.llm_engine.vllm_config, drafter_of(llm)
        return (config, drafter.memory_plan(), config.cache_config.kv_cache_memory_bytes,
                (drafter.summaries.num_blocks, drafter.reserved_bytes))
    finally:
        free_llm(llm)


def flashinfer_worker_plan(tiny_llama):
    """(config, the worker's plan) for FLASHINFER: the config sized on this CPU, and
    `TriForceProposer.memory_plan` of a worker whose layers got FLASHINFER, over the KV-cache
    spec vLLM gives each of them (`FullAttentionSpec`, vllm/v1/kv_cache_interface.py)."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_triforce.engine.proposer import TriForceProposer
    from vllm_triforce.engine.shape import EngineShape

    config = EngineArgs(model=str(tiny_llama), speculative_config=dict(AGREEMENT_SPEC),
                        attention_backend="FLASHINFER",
                        **make_engine_kwargs(max_num_seqs=2)).create_engine_config()
    model = config.model_config
    layers = model.get_num_layers(config.parallel_config)
    spec = FullAttentionSpec(block_size=config.cache_config.block_size,
                             num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                             head_size=model.get_head_size(), dtype=model.dtype)
    backend = SimpleNamespace(get_name=lambda: "FLASHINFER")
    worker = SimpleNamespace(
        shape=EngineShape.of(config), vllm_config=config,
        _kv_cache_specs=lambda: {f"layers.{i}": spec for i in range(layers)},
        target_layers=[SimpleNamespace(attn_backend=backend)])
    return config, TriForceProposer.memory_plan(worker)


def test_flashinfers_plan_adds_one_per_layer_builder_per_target_layer(tiny_llama):
    """FLASHINFER's plan is CPU_ATTN's plus one per-layer builder's fixed part per target
    layer (`EngineShape.builder_bytes`), and nothing per block."""
    import dataclasses

    from vllm_triforce.engine.shape import EngineShape

    config, flashinfer = flashinfer_worker_plan(tiny_llama)
    shape = EngineShape.of(config)
    stateless = shape.memory_plan(flashinfer.kv_bytes_per_block, "CPU_ATTN")
    per_block, fixed = shape.one_builder_bytes("FLASHINFER")
    assert per_block == 0 and fixed > 0
    assert flashinfer == dataclasses.replace(stateless, builder_bytes=2 * fixed)

def test_round_graphs_reserve_the_window_layers_tables_of_each_group():
    """A target with sliding-window layers beside its full ones: `EngineShape.window_groups`
    counts the KV-cache groups vLLM's hybrid manager makes of them (Gemma 3's 52 beside 10
    full: 6; gpt-oss's 18 beside 18: 1; none: 0), and `round_graphs` reserves, per group,
    a table of max_model_len's blocks and one slot a token for every request the buffers
    hold, and the true lengths once (round_graph.PassBuffers)."""
    def plan(local: int, full: int = 32):
        eager = llama_8b_plan(round_graphs=True)
        shape = dataclasses.replace(eager.shape, local_layers=local, num_layers=full)
        return shape, shape.memory_plan(KV_8B, backend=None).sized(53_000)

    assert plan(0)[0].window_groups == 0
    assert plan(52, 10)[0].window_groups == 6
    assert plan(18, 18)[0].window_groups == 1
    shape, none = plan(0, 18)
    _, windowed = plan(18, 18)
    bounds = shape.round_bounds(none.drafting)
    width = shape.max_blocks + 1  # 8,193 blocks of 16 tokens for 131,072
    assert width == 8_193 and none.drafting == windowed.drafting
    assert windowed.round_bytes - none.round_bytes == (
        bounds.max_requests * width * 4 + bounds.max_tokens * 8 + bounds.max_requests * 4)
