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
