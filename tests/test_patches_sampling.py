"""The CPU sampling patches took effect and make vLLM 0.32's CPU runner correct.

- patches/cpu_expand.py (vllm#55005): the original expand leaves non-int64
  buffers unwritten; ours matches a reference; the override registered for the
  rejection sampler is ours; a model drafting for itself at T=0.8 accepts 100%.
- patches/cpu_seed.py: plain vLLM crashes on a seeded request whose prefill is
  chunked; patched, the tokens are reproducible and equal plain vLLM's on an
  unchunked run with the same seeds.
- patches/plain_params.py: min_p and logit_bias pass a TriForce engine's request check
  only (the engine test is tests/test_engine_depth_rules.py).

"Plain vLLM" runs in a subprocess with VLLM_PLUGINS="" (no plugin loaded).
Run this file as a script (`python tests/test_patches_sampling.py seeded MODEL
MAX_NUM_BATCHED_TOKENS`) to print one run's seeded tokens as JSON.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import tiny_models

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

# Seeded-run workload: every prompt is longer than the chunked budget, and all
# of them fit in the unchunked budget in one step.
SEEDS = (11, 12, 13)
PROMPT_WORDS = 300  # ~550 tokens with the tiny tokenizer
CHUNKED_BUDGET = 128  # max_num_batched_tokens: prefill takes ~5 chunks
UNCHUNKED_BUDGET = 2048  # >= the sum of all prompt lengths
CPU_OFFSET_ERROR = "CPU Generator does not use offset"


# --- the shared tiny models (tests/tiny_models.py) --------------------------------

def test_tiny_models_are_deterministic_and_not_degenerate(tiny_llama, tiny_qwen2, tiny_draft,
                                                          tmp_path):
    rebuilt = tiny_models.build_tiny_llama(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (rebuilt / name).read_bytes() == (tiny_llama / name).read_bytes()
    for path in (tiny_llama, tiny_qwen2, tiny_draft):
        assert tiny_models.is_non_degenerate(path)
    assert not tiny_models.is_non_degenerate(  # the usual init scale: nearly uniform
        tiny_models.build_tiny_llama(tmp_path / "flat", init_scale=0.02))


# --- cpu_expand ----------------------------------------------------------------

def _expand_reference(output, input_val, cu_num_tokens, replace_from, replace_to):
    start = 0
    for value, end in zip(input_val.tolist(), cu_num_tokens.tolist()):
        output[start:end] = replace_to if value == replace_from else value
        start = end


def _original_and_patched_expand():
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    from vllm_triforce.patches import _util, cpu_expand

    current_platform.import_kernels()  # the C++ op the original calls
    cpu_expand.apply()
    patched = cpu_tl._expand_kernel_impl
    assert _util.is_patched(patched)
    return patched.__wrapped__, patched


EXPAND_CASES = [
    (torch.float32, [0.8, 0.0, 1.5], 0, 1),  # temperature: greedy 0 -> 1
    (torch.int32, [5, 0, 40], 0, 0),  # top_k
    (torch.float32, [0.9, 1.0, 0.5], 0, 0),  # top_p
    (torch.int64, [7, 0, 3], 0, 9),
]


@pytest.mark.parametrize("dtype,values,replace_from,replace_to", EXPAND_CASES)
def test_expand_matches_reference(dtype, values, replace_from, replace_to):
    _, patched = _original_and_patched_expand()
    input_val = torch.tensor(values, dtype=dtype)  # [batch_size]
    cu_num_tokens = torch.tensor([2, 2, 6], dtype=torch.int32)  # one request has no drafts
    expected = torch.full((8,), -3, dtype=dtype)  # 2 trailing slots stay untouched
    _expand_reference(expected, input_val, cu_num_tokens, replace_from, replace_to)
    output = torch.full((8,), -3, dtype=dtype)
    patched(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=4)
    assert torch.equal(output, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_original_expand_leaves_non_int64_output_unwritten(dtype):
    """The bug the patch fixes (vllm#55005), on the very function vLLM registers."""
    original, patched = _original_and_patched_expand()
    input_val = torch.tensor([2, 0, 4], dtype=dtype)  # [batch_size]
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    sentinel = torch.full((6,), -3, dtype=dtype)
    output = sentinel.clone()
    original(output, input_val, cu_num_tokens, 0, 1)
    assert torch.equal(output, sentinel)
    patched(output, input_val, cu_num_tokens, 0, 1)
    assert output.tolist() == [2, 2, 1, 1, 1, 4]


def test_expand_override_registered_before_apply_is_repointed():
    """apply() after CpuPlatform registered the buggy impl still routes the kernel to ours."""
    script = (
        "from vllm.platforms import current_platform as p\n"
        "p.import_kernels(); p.register_triton_kernel_overrides()\n"
        "from vllm.v1.sample import rejection_sampler as rs\n"
        "from vllm_triforce.patches import _util, cpu_expand\n"
        "before = _util.is_patched(rs.expand_kernel._impl)\n"
        "cpu_expand.apply()\n"
        "print('RESULT', before, _util.is_patched(rs.expand_kernel._impl))\n")
    proc = _run_plain_vllm(["-c", script])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT False True" in proc.stdout


def _spec_metrics(llm) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_draft_tokens",
                          "vllm:spec_decode_num_accepted_tokens")}


@pytest.mark.engine
def test_self_draft_accepts_every_token_at_temperature(tiny_llama, llm_factory):
    from vllm import SamplingParams
    from vllm.utils import cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_triforce.patches import _util

    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    llm = llm_factory(tiny_llama, speculative_config=spec, disable_log_stats=False)
    # The engine's worker registered the CPU kernel overrides: expand is ours.
    assert _util.is_patched(cpu_tl._expand_kernel_impl)
    assert rs.expand_kernel._impl is cpu_tl._expand_kernel_impl
    prompts = [tiny_models.make_text(40, seed=s) for s in range(2)]
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.8, ignore_eos=True))
    metrics = _spec_metrics(llm)
    # Unpatched, this run accepted 2 of 183 draft tokens.
    assert metrics["vllm:spec_decode_num_draft_tokens"] >= 30
    assert (metrics["vllm:spec_decode_num_accepted_tokens"]
            == metrics["vllm:spec_decode_num_draft_tokens"])


# --- per-request seeds -----------------------------------------------------------

def _seeded_prompts_and_params():
    from vllm import SamplingParams

    prompts = [tiny_models.make_text(PROMPT_WORDS, seed=s) for s in range(len(SEEDS))]
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=seed, ignore_eos=True)
              for seed in SEEDS]
    return prompts, params


def seeded_tokens(llm) -> list[list[int]]:
    prompts, params = _seeded_prompts_and_params()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert min(len(o.prompt_token_ids) for o in outputs) > CHUNKED_BUDGET
    assert sum(len(o.prompt_token_ids) for o in outputs) <= UNCHUNKED_BUDGET
    return [list(o.outputs[0].token_ids) for o in outputs]


def _seeded_engine_kwargs(budget: int) -> dict:
    return dict(max_num_batched_tokens=budget, enable_chunked_prefill=True)


def _run_plain_vllm(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_PLUGINS="")  # allow-list with no plugin in it
    return subprocess.run([sys.executable, *args], env=env, capture_output=True,
                          text=True, timeout=600)


def _plain_vllm_seeded(model, budget: int) -> subprocess.CompletedProcess:
    return _run_plain_vllm([__file__, "seeded", str(model), str(budget)])


@pytest.mark.engine
def test_plain_vllm_crashes_on_chunked_seeded_prefill(tiny_llama):
    proc = _plain_vllm_seeded(tiny_llama, CHUNKED_BUDGET)
    assert proc.returncode != 0
    assert CPU_OFFSET_ERROR in proc.stderr


@pytest.mark.engine
def test_seeded_chunked_prefill_matches_plain_unchunked(tiny_llama, llm_factory):
    from vllm_triforce.patches import applied

    proc = _plain_vllm_seeded(tiny_llama, UNCHUNKED_BUDGET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = json.loads(proc.stdout.strip().splitlines()[-1])

    runs = []
    for _ in range(2):
        llm = llm_factory(tiny_llama, **_seeded_engine_kwargs(CHUNKED_BUDGET))
        runs.append(seeded_tokens(llm))
    assert applied().get("cpu_seed")
    assert len({tuple(tokens) for tokens in reference}) == len(SEEDS)  # seeds matter
    assert runs[0] == runs[1] == reference


def _main(argv: list[str]) -> None:
    """`seeded MODEL BUDGET`: print the seeded tokens of one engine as JSON."""
    from engine_helpers import in_process_llm, make_engine_kwargs

    _, model, budget = argv
    llm = in_process_llm(model, **make_engine_kwargs(**_seeded_engine_kwargs(int(budget))))
    print(json.dumps(seeded_tokens(llm)))


if __name__ == "__main__":
    _main(sys.argv[1:])


def test_plain_params_lets_min_p_and_logit_bias_through_for_triforce_only():
    from vllm import SamplingParams
    from vllm.config import SpeculativeConfig
    from vllm.exceptions import VLLMValidationError

    from vllm_triforce.patches import applied, plain_params

    plain_params.apply()
    assert applied().get("plain_params")
    any_spec = SpeculativeConfig.__new__(SpeculativeConfig)  # vLLM reads only its presence
    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 1.0})):
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative"):
            params._validate_spec_decode(any_spec)  # another method's engine: vLLM's refusal
        token = plain_params._TRIFORCE_REQUEST.set(True)  # a TriForce front end's check
        try:
            params._validate_spec_decode(any_spec)
        finally:
            plain_params._TRIFORCE_REQUEST.reset(token)
