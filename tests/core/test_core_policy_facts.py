"""One table of policy facts (core/policy_facts.py): the memory plan reserves exactly what
the proposer allocates, for every policy, and what is allocated is what the policy reads."""

import subprocess
import sys

import pytest
import torch

from vllm_triforce.config import FULL_KEY_POLICIES, POLICIES, TriForceConfig
from vllm_triforce.core.policies import POLICIES as POLICY_CLASSES
from vllm_triforce.core.policies import make_policy
from vllm_triforce.core.policy_facts import POLICY_FACTS
from vllm_triforce.engine.memory import allocate_summaries, summary_dtype
from vllm_triforce.engine.shape import EngineShape

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 3, 2, 8, 4, 10


@pytest.mark.parametrize("key_variance,compact,coded", [
    (True, False, True), (True, False, False), (True, True, False), (False, False, True),
    (False, False, False)])
@pytest.mark.parametrize("kv_dtype,model_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.uint8, torch.bfloat16),  # an fp8 KV cache: vLLM's KV spec says uint8
])
@pytest.mark.parametrize("policy", POLICIES)
def test_plan_reserves_what_the_allocation_holds(policy, kv_dtype, model_dtype, key_variance,
                                                  compact, coded):
    cfg = TriForceConfig(selection_policy=policy, key_variance=key_variance,
                         compact_key_variance=compact, compact_summaries=coded,
                         allow_full_key_copy=policy in FULL_KEY_POLICIES)
    kinds = cfg.summary_kinds()
    dtype = summary_dtype(kv_dtype, model_dtype)  # as the proposer's plan and allocation
    shape = EngineShape.from_sizes(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                   vocab_size=16, block_size=BLOCK, max_num_seqs=1, cfg=cfg,
                                   summary_dtype=dtype)
    plan = shape.memory_plan(LAYERS * 2 * BLOCK * HEADS * DIM * kv_dtype.itemsize, backend=None)
    summaries = allocate_summaries(kinds, LAYERS, NUM_BLOCKS, HEADS, DIM, BLOCK, dtype)
    assert summaries.nbytes() == (NUM_BLOCKS * plan.summary_bytes_per_block
                                  + plan.sized(NUM_BLOCKS).profile_bytes)
    assert plan.sized(NUM_BLOCKS).profile_bytes == (LAYERS * HEADS * DIM * 4
                                                    if kinds.compact_variance else 0)
    # ... and it is what the configured policy reads: it scores with it
    scorer = make_policy(policy, **cfg.policy_kwargs())
    num_committed = torch.tensor([5 * BLOCK])
    block_table = torch.arange(6)[None]
    positions = torch.arange(5 * BLOCK)
    summaries.add_committed([torch.randn(5 * BLOCK, HEADS * DIM)] * LAYERS, positions,
                            block_table[0, positions // BLOCK], positions % BLOCK)
    scores = scorer.block_scores(torch.randn(1, LAYERS, 2 * HEADS, DIM), summaries, block_table,
                                 num_committed)
    assert scores.shape == (1, LAYERS, 6) and scores[..., :5].isfinite().all()


def test_policy_classes_take_their_flags_from_the_table():
    assert set(POLICY_CLASSES) == set(POLICY_FACTS) == set(POLICIES)
    for name, cls in POLICY_CLASSES.items():
        facts = POLICY_FACTS[name]
        assert (cls.needs_keys, cls.needs_bounds, cls.reranks_shortlist, cls.exact_stage) == (
            facts.keeps_keys, facts.keeps_bounds, facts.reranks_shortlist,
            facts.exact_stage), name
    for name in POLICIES:
        kinds = TriForceConfig(selection_policy=name, key_variance=True,
                               allow_full_key_copy=True).summary_kinds()
        policy = make_policy(name, **TriForceConfig(selection_policy=name,
                                                    allow_full_key_copy=True).policy_kwargs())
        assert (kinds.keep_keys, kinds.keep_bounds, kinds.keep_variance) == (
            policy.needs_keys, policy.needs_bounds, policy.needs_variance), name


def test_config_reads_the_table_without_torch():
    code = ("import sys, vllm_triforce.config as c; "
            "assert c.TriForceConfig(selection_policy='quest').summary_kinds().keep_bounds; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
