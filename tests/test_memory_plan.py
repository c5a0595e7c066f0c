"""What `propose` allocates stays within what engine/memory.py reserved (issue 25).

A tiny target with a 152,064-token vocabulary (Qwen2.5's), gamma2 = 6, top-p sampling, two
and three levels: torch's memory profiler records every allocation of a few `propose` calls
on CPU; the peak of what each call allocated (and held at once) plus the preallocated
probability buffer must fit the plan's fixed part (`MemoryPlan.fixed_bytes`, from
`vocabulary_rows`). The model's forwards inside `propose` count too: on a GPU their logits
are TriForce's as well.
"""

import pytest
import tiny_models
from engine_helpers import assert_drafted, drafter_of, free_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

VOCAB = 152_064
BATCH = 4
PROFILED_CALLS = (2, 3)  # decode steps (call 1 is the prefill)


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


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("big_vocab")
    return (tiny_models.build_tiny_llama(path / "target", num_layers=2, hidden=64, heads=2,
                                         kv_heads=2, vocab_size=VOCAB),
            tiny_models.build_tiny_llama_draft(path / "draft", vocab_size=VOCAB))


@pytest.mark.parametrize("levels", [2, 3])
def test_propose_peak_fits_the_reserved_memory(levels, big_vocab):
    from vllm import LLM, SamplingParams

    target, draft = big_vocab
    spec = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 160,
            "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32, "adaptive": False}
    if levels == 3:
        spec.update(model=str(draft), draft_window_tokens=96, draft_tokens_per_round=2)
    llm = LLM(str(target), speculative_config=spec,
              **make_engine_kwargs(max_num_seqs=BATCH, max_model_len=2048))
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
        prompts = [tiny_models.make_text(300, seed=i) for i in range(BATCH)]
        llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4,
                                             ignore_eos=True), use_tqdm=False)
        stats = drafter.stats.snapshot()
        plan, buffer = drafter.memory_plan(), drafter._probs_buffer
    finally:
        free_llm(llm)
    assert_drafted(stats, levels)
    row = VOCAB * 4
    print(f"\n{levels} levels: propose peaks {[round(p / row, 1) for p in peaks]} vocabulary "
          f"rows + buffer {buffer.numel() * 4 / row:.0f}; reserved {plan.fixed_bytes / row:.0f}")
    assert len(peaks) == len(PROFILED_CALLS) and min(peaks) > 0
    assert buffer.nbytes + max(peaks) <= plan.fixed_bytes


@pytest.mark.parametrize("strategy,chunk_kib", [("gather", 256), ("all", 256),
                                                ("gather", 4096)])
def test_selection_scratch_fits_its_reservation(monkeypatch, strategy, chunk_kib):
    """A step-start selection (every candidate scored, the shortlist kept) and a middle
    re-ranking hold at most `selection_scratch_bytes` at once: profiled on CPU with a small
    SCORE_CHUNK_BYTES, so the chunked reads are chunked here too (8 requests, 4 layers,
    96-block tables; no stacked queries: `choose` takes them gathered). With 4 MiB chunks
    the re-ranking keeps a copy of the listed summaries (2.6 MiB, `listed_copy`), alive
    after the call: counted in the middle's peak."""
    import torch

    from vllm_triforce.core import policies
    from vllm_triforce.core.policies import make_policy
    from vllm_triforce.core.selection import Selector
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.config import BlockCounts
    from vllm_triforce.engine import memory, retrieval_level

    monkeypatch.setattr(policies, "SCORE_CHUNK_BYTES", chunk_kib * 2**10)
    monkeypatch.setattr(retrieval_level, "STACKED_QUERIES_BYTES", 0)
    reqs, layers, heads, dim, q_heads, bs, width = 8, 4, 2, 64, 4, 16, 96
    gen = torch.Generator().manual_seed(0)
    summaries = BlockSummaries(layers, reqs * width, heads, dim, bs, keep_variance=True)
    summaries.sums.normal_(generator=gen)
    summaries.square_deviations.uniform_(generator=gen)
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
    bound = memory.selection_scratch_bytes(reqs, layers, width, heads, dim, q_heads)
    print(f"\n{strategy}: peaks {at_start} (step start), {in_middle} (middle); bound {bound}")
    assert max(at_start, in_middle) <= bound
    assert at_start > bound // 4  # the bound is of the right size, not a blanket


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fold_scratch_fits_its_reservation(monkeypatch, dtype):
    """Folding a prefill pass's keys into the summaries (engine/retrieval_level.py, by
    pieces of SCORE_CHUNK_BYTES of float32 keys) holds at most `fold_scratch_bytes` at once:
    profiled on CPU with SCORE_CHUNK_BYTES cut to 64 KiB (2 requests' prompt chunks of
    700 and 333 tokens, the second starting inside a block; 4 layers of 2 x 64 keys, key
    variance and bounds). Folded whole, the same pass would not fit; by pieces it ends
    with the same summaries."""
    from types import SimpleNamespace

    import torch

    from vllm_triforce.core import policies
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.engine import memory
    from vllm_triforce.engine.retrieval_level import RetrievalLevel, fold_committed

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
        monkeypatch.setattr(policies, "SCORE_CHUNK_BYTES", chunk_bytes)
        level = RetrievalLevel.__new__(RetrievalLevel)
        level.blocks = SimpleNamespace(block_size=bs)
        level.device = torch.device("cpu")
        level.summaries = BlockSummaries(layers, 2 * width, heads, dim, bs,
                                         dtype=getattr(torch, dtype), keep_bounds=True,
                                         keep_variance=True)

        def run():
            for committed in level._committed_tokens(batch, [0, 1]):
                fold_committed(level.summaries, keys, committed)

        return level, peak_bytes(run)[1]

    level, peak = fold(64 * 2**10)
    assert level.fold_tokens() == 32
    bound = memory.fold_scratch_bytes(sum(lens), layers, heads, dim)
    whole, whole_peak = fold(2**40)
    print(f"\n{dtype}: peak {peak} by pieces, {whole_peak} whole; bound {bound}")
    assert bound // 4 < peak <= bound < whole_peak
    for store in ("sums", "square_deviations", "mins", "maxs"):
        assert torch.allclose(getattr(level.summaries, store).float(),
                              getattr(whole.summaries, store).float(),
                              rtol=1e-2, atol=1e-2), store
    assert torch.equal(level.summaries.counts, whole.summaries.counts)
