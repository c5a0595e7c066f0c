"""fp8 KV caches: the block summaries stay in a float dtype, so keys that went through fp8
keep their mean (within fp8 rounding) and `quest`'s bounds can hold +-inf.

vLLM's KV-cache spec says `torch.uint8` for an fp8 cache; `summary_dtype`
(engine/memory.py) is the one place that turns that into the summaries' dtype. The keys
the engine captures are in the model's dtype: here, float keys quantised to fp8 with a
scale and dequantised back (what an fp8 cache round-trips), in bfloat16.
"""

import pytest
import torch

from vllm_triforce.config import TriForceConfig
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.summaries import BlockSummaries
from vllm_triforce.engine.memory import summary_dtype

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 32, 16, 6
MODEL_DTYPE = torch.bfloat16
FP8_RELATIVE_ROUNDING = 2.0**-4  # float8_e4m3fn: 3 mantissa bits, half an ulp relative
FP8_KV_SPEC_DTYPE = torch.uint8  # vLLM 0.32 STR_DTYPE_TO_TORCH_DTYPE["fp8"]


@pytest.mark.parametrize("kv_dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn,
                                      torch.float8_e5m2])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_eight_bit_cache_keeps_summaries_in_the_model_dtype(kv_dtype, model_dtype):
    assert summary_dtype(kv_dtype, model_dtype) == model_dtype


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_float_cache_keeps_summaries_in_its_own_dtype(kv_dtype):
    assert summary_dtype(kv_dtype, torch.float32) == kv_dtype


def fp8_round_trip(keys: torch.Tensor, scale: float) -> torch.Tensor:
    """keys -> fp8 (keys / scale, as vLLM writes an fp8 cache) -> keys again, in the model
    dtype."""
    quantised = (keys / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (quantised.float() * scale).to(MODEL_DTYPE)


def committed(kinds: dict, keys: torch.Tensor) -> BlockSummaries:
    """keys [L, NUM_BLOCKS * BLOCK, H * D], token t in block t // BLOCK, all committed."""
    summaries = BlockSummaries(LAYERS, NUM_BLOCKS, HEADS, DIM, BLOCK,
                               dtype=summary_dtype(FP8_KV_SPEC_DTYPE, MODEL_DTYPE), **kinds)
    positions = torch.arange(keys.shape[1])
    summaries.add_committed(list(keys), positions, positions // BLOCK, positions % BLOCK)
    return summaries


def float_keys(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(LAYERS, NUM_BLOCKS * BLOCK, HEADS * DIM, generator=gen)


def test_mean_keys_of_fp8_keys_match_float32_within_fp8_rounding():
    keys = float_keys()
    summaries = committed({}, fp8_round_trip(keys, scale=0.05))
    assert summaries.sums.dtype == MODEL_DTYPE
    # [L, num_blocks, H, D]
    means = summaries.sums.float() / summaries.counts.float()[:, None, None]
    blocks = keys.view(LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM)
    exact = blocks.mean(2)
    # each key is off by at most its fp8 rounding; bfloat16 sums of BLOCK keys add ~BLOCK ulps
    bound = FP8_RELATIVE_ROUNDING * blocks.abs().mean(2) + BLOCK * 2.0**-8 * blocks.abs().amax(2)
    assert ((means - exact).abs() <= bound).all()
    # ... and the mean keys still tell the blocks apart: over many queries, the top block
    # is float32's (a query whose two best blocks are nearly tied may flip: 0.99 measured;
    # keys cast to uint8 agree 0.00, shuffled blocks 0.19). Seeded: the global generator
    # made this check depend on the tests run before it.
    queries = torch.randn(256, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    score = torch.einsum("lbhd,qhd->qlb", means, queries)
    exact_score = torch.einsum("lbhd,qhd->qlb", exact, queries)
    assert (score.argmax(-1) == exact_score.argmax(-1)).float().mean() >= 0.95


def test_quest_builds_on_an_fp8_cache_and_scores_finite():
    keys = fp8_round_trip(float_keys(1), scale=0.05)
    summaries = committed({"keep_bounds": True}, keys)
    mins, maxs = summaries.bounds(0, torch.arange(NUM_BLOCKS)[None])  # [1, B, H, D] each
    layer0 = keys[0].float().view(NUM_BLOCKS, BLOCK, HEADS, DIM)
    assert torch.equal(mins[0], layer0.amin(1)) and torch.equal(maxs[0], layer0.amax(1))
    scorer = make_policy("quest", **TriForceConfig(selection_policy="quest").policy_kwargs())
    query = torch.randn(1, LAYERS, 2 * HEADS, DIM).to(torch.float8_e4m3fn).float()
    scores = scorer.block_scores(query, summaries, torch.arange(NUM_BLOCKS)[None],
                                 torch.tensor([NUM_BLOCKS * BLOCK]))
    assert scores.shape == (1, LAYERS, NUM_BLOCKS) and scores.isfinite().all()
