"""TriForce under a STATEFUL attention-metadata builder: vLLM's FLEX_ATTENTION on this CPU.

The middle level gives every target layer its own block table (engine/device/forward.py
`layer_metadata`). FLEX_ATTENTION's builder keeps persistent buffers that the metadata it
returns points into (`physical_to_logical`, `kv_indices`; vllm/v1/attention/backends/
flex_attention.py, 0.32.0), so two builds through one builder leave the first metadata
describing the second table: every layer would attend over the last layer's selection.
Outputs stay identical (the top level verifies), only acceptance drops, so the test that
sees it compares acceptance with CPU_ATTN (stateless builder) on the same prompts.

FLEX runs here through the test patch `tests/cpu_flex.py` (env `VLLM_TRIFORCE_CPU_FLEX=1`),
whose eager kernel attends densely over the whole KV cache, so engines get a small cache
(`NUM_BLOCKS`).
"""

import contextlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine_helpers import (assert_drafted, drafter_of, free_llm, in_process_llm,
                            make_engine_kwargs, record_rerank_calls, runner_of)
from test_triforce_engine import generate, three_level, two_level

pytestmark = pytest.mark.engine

ENV = "VLLM_TRIFORCE_CPU_FLEX"
BACKENDS = ("CPU_ATTN", "FLEX_ATTENTION")
NUM_BLOCKS = 96  # 3072 tokens of 32: the test prompts (~1.6K tokens in all) fit at once


@pytest.fixture(scope="module", autouse=True)
def cpu_flex_patch():
    """Apply the gated patch in this process (the plugin's register() may already have run
    without the env variable, in which case it recorded the patch as not applicable)."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1"
    import cpu_flex
    from vllm_triforce.patches import _util

    _util.check_version()
    cpu_flex.apply()
    yield
    if before is None:
        os.environ.pop(ENV)
    else:
        os.environ[ENV] = before


def on(backend: str) -> dict:
    """Engine kwargs selecting `backend` (the same small cache for every backend)."""
    return {"attention_config": {"backend": backend}, "num_gpu_blocks_override": NUM_BLOCKS}


_RUNS: dict = {}
_PLANS: dict = {}  # run key -> the TriForce engine's MemoryPlan


def run(model, backend, spec=None):
    """(tokens, TriForce stats) of the shared prompts, cached: each engine is built once."""
    key = (model, backend, None if spec is None else repr(sorted(spec.items())))
    if key not in _RUNS:
        keep_plan = (lambda llm: _PLANS.__setitem__(key, drafter_of(llm).memory_plan())
                     ) if spec else None
        _RUNS[key] = generate(model, spec, on_engine=keep_plan, **on(backend))[:2]
    return _RUNS[key]


@contextlib.contextmanager
def attention_groups(model, backend):
    """The runner's attention groups of a plain engine on `backend` (freed on exit)."""
    llm = in_process_llm(model, **make_engine_kwargs(**on(backend)))
    try:
        runner = runner_of(llm)
        yield [g for groups in runner.attn_groups for g in groups]
    finally:
        free_llm(llm)


def decode_pass():
    """Two requests decoding one token each; 40 and 70 tokens = 2 and 3 blocks of 32."""
    from vllm_triforce.engine.device.forward import PassInputs

    return PassInputs.make([0, 1, 2], [40, 70], [0, 1],
                           input_ids=torch.tensor([5, 6], dtype=torch.int32),
                           positions=torch.tensor([39, 69]), slot_mapping=torch.tensor([39, 101]))


# Two layers, two different tables [num_reqs, width] (0 pads past each row's blocks).
TABLES = (torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]]), torch.tensor([[6, 7, 0, 0], [8, 9, 10, 0]]))


def test_flex_is_the_backend_used(tiny_llama):
    with attention_groups(tiny_llama, "FLEX_ATTENTION") as groups:
        names = {g.backend.get_name() for g in groups}
    assert names == {"FLEX_ATTENTION"}


def test_flex_layers_keep_their_own_tables(tiny_llama):
    """Each layer's FLEX metadata must describe its own table. With one shared builder the
    first layer's `physical_to_logical` (what its mask reads) and block-mask `kv_indices`
    are the builder's persistent buffers, rewritten by the second layer's build."""
    from vllm.v1.attention.backends.flex_attention import physical_to_logical_mapping

    from vllm_triforce.engine.device.forward import layer_metadata

    inputs = decode_pass()
    with attention_groups(tiny_llama, "FLEX_ATTENTION") as groups:
        (group,) = groups
        names = group.layer_names
        limits = two_level_pass_limits(group.get_metadata_builder().vllm_config)
        metas = layer_metadata(groups, inputs, dict(zip(names, TABLES)), limits)
        for name, table in zip(names, TABLES):
            meta = metas[name]
            num_blocks = meta.physical_to_logical.shape[1]
            expected = physical_to_logical_mapping(table, inputs.seq_lens_dev, 32, num_blocks)
            assert torch.equal(meta.physical_to_logical[:2], expected), name
            used = meta.block_mask.kv_indices[0, 0, 0, :meta.block_mask.kv_num_blocks[0, 0, 0]]
            assert set(used.tolist()) - {0} == set(table.flatten().tolist()) - {0}, name
        assert_builders_within_plan(group)


def two_level_pass_limits(config):
    """The limits of a two-level engine's middle pass with `config`'s scheduler (one token
    of each drafting request: engine/shape.py `pass_limits`, as `EngineShape.of` uses it)."""
    from vllm_triforce.engine.shape import pass_limits

    sched = config.scheduler_config
    return pass_limits(sched.max_num_seqs, sched.max_num_batched_tokens, gamma1=0)


def assert_builders_within_plan(group) -> None:
    """The per-layer builders are made for a middle pass's limits (`PassLimits`), and what
    each keeps after a build fits `per_layer_builder_bytes`, which MemoryPlan reserves."""
    from vllm_triforce.engine.device import forward
    from vllm_triforce.engine.shape import per_layer_builder_bytes

    layer_groups = forward._LAYER_GROUPS[group]
    assert set(layer_groups) == set(group.layer_names)
    config = group.get_metadata_builder().vllm_config
    limits = two_level_pass_limits(config)
    assert limits.requests == min(config.scheduler_config.max_num_seqs, 32) < \
        config.scheduler_config.max_num_seqs
    per_block, fixed = per_layer_builder_bytes(
        "FLEX_ATTENTION", limits, pages=-(-config.model_config.max_model_len // 32))
    for layer_group in layer_groups.values():
        builder = layer_group.get_metadata_builder()
        assert builder.vllm_config.scheduler_config.max_num_seqs == limits.requests
        kept = _tensor_bytes(builder)
        print(f"per-layer builder keeps {kept} B; planned {per_block * NUM_BLOCKS + fixed} B")
        assert 0 < kept <= per_block * NUM_BLOCKS + fixed


def _tensor_bytes(builder) -> int:
    """Bytes of the tensors a builder holds (CpuGpuBuffer: both copies)."""
    total = 0
    for value in vars(builder).values():
        for tensor in (value, getattr(value, "cpu", None), getattr(value, "gpu", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


def test_stateless_backend_builds_once_per_pass(tiny_llama, monkeypatch):
    """CPU_ATTN: one build per pass, then each layer a shallow copy with its own table."""
    from vllm_triforce.engine.device.forward import layer_metadata

    with attention_groups(tiny_llama, "CPU_ATTN") as groups:
        (group,) = groups
        builder = group.get_metadata_builder()
        builds, original = [], builder.build

        def counting_build(*args, **kwargs):
            builds.append(args)
            return original(*args, **kwargs)

        monkeypatch.setattr(builder, "build", counting_build)
        names = group.layer_names
        metas = layer_metadata(groups, decode_pass(), dict(zip(names, TABLES)))
    assert len(builds) == 1
    for name, table in zip(names, TABLES):
        assert torch.equal(metas[name].block_table, table.to(torch.int32)), name
    first, second = (metas[n] for n in names)
    assert first.scheduler_metadata is second.scheduler_metadata


def test_unknown_backend_is_refused_with_the_fix():
    from vllm_triforce.config import SUPPORTED_ATTENTION_BACKENDS, TriForceConfigError
    from vllm_triforce.engine.device.forward import METADATA_PATHS, layer_metadata

    assert set(METADATA_PATHS) == set(SUPPORTED_ATTENTION_BACKENDS)
    backend = types.SimpleNamespace(get_name=lambda: "XFORMERS")
    group = types.SimpleNamespace(backend=backend, layer_names=["a", "b"])
    with pytest.raises(TriForceConfigError, match="XFORMERS.*--attention-backend") as err:
        layer_metadata([group], decode_pass(), {"a": TABLES[0], "b": TABLES[1]})
    assert "TriForce" in str(err.value) and "FLEX_ATTENTION" in str(err.value)


def test_patch_changes_nothing_without_the_env_variable():
    """In a fresh process without VLLM_TRIFORCE_CPU_FLEX, apply() records the patch as not
    applicable and leaves the CPU platform and the FLEX module as they were."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})" + """
import cpu_flex
import vllm.platforms.cpu as cpu, vllm.v1.attention.backends.flex_attention as flex
from vllm_triforce.patches import _util
before = (cpu.CpuPlatform.__dict__["get_attn_backend_cls"], flex.flex_attention_compiled,
          flex.create_block_mask_compiled, flex.FlexAttentionImpl.do_kv_cache_update)
cpu_flex.apply()
after = (cpu.CpuPlatform.__dict__["get_attn_backend_cls"], flex.flex_attention_compiled,
         flex.create_block_mask_compiled, flex.FlexAttentionImpl.do_kv_cache_update)
assert all(a is b for a, b in zip(before, after)), after
assert _util.APPLIED["cpu_flex"] is False
print("unchanged")
"""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-2000:]


def test_plan_reserves_the_per_layer_builders(tiny_llama):
    """A FLEX engine's MemoryPlan adds, over CPU_ATTN's, one per-layer builder per target
    layer (and one build's transient block map), as `per_layer_builder_bytes` sizes them."""
    from vllm_triforce.engine.shape import BUILDER_PASS_REQUESTS

    run(tiny_llama, "CPU_ATTN", two_level())
    run(tiny_llama, "FLEX_ATTENTION", two_level())
    key = repr(sorted(two_level().items()))
    stateless = _PLANS[(tiny_llama, "CPU_ATTN", key)]
    flex = _PLANS[(tiny_llama, "FLEX_ATTENTION", key)]
    layers, requests = 2, BUILDER_PASS_REQUESTS  # tiny_llama; a builder pass's requests
    assert flex.kv_bytes_per_block == stateless.kv_bytes_per_block
    assert flex.summary_bytes_per_block - stateless.summary_bytes_per_block == \
        (layers + 1) * 8 * requests
    assert flex.fixed_bytes > stateless.fixed_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_level_greedy_identical(tiny_llama, backend):
    tokens, stats = run(tiny_llama, backend, two_level())
    assert tokens == run(tiny_llama, backend)[0]
    assert_drafted(stats)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_level_greedy_identical(tiny_qwen2, tiny_draft, backend):
    """The small draft follows the target's backend (engine_settings.draft_backend)."""
    spec = three_level(tiny_draft)
    tokens, stats = run(tiny_qwen2, backend, spec)
    assert tokens == run(tiny_qwen2, backend)[0]
    assert_drafted(stats, levels=3)


def test_full_cache_acceptance_equals_cpu_attn(tiny_llama):
    """Same prompts, greedy: per-layer retrieval tables give the same acceptance whatever
    the builder. With one shared FLEX builder (every layer attending over the last layer's
    selection) this read 27/460 against CPU_ATTN's 25/468; tokens were identical."""
    accepted = {}
    for backend in BACKENDS:
        stats = run(tiny_llama, backend, two_level())[1]
        accepted[backend] = (stats["top_accepted"], stats["top_proposed"])
    print(f"full-cache acceptance (accepted, proposed): {accepted}")
    assert accepted["FLEX_ATTENTION"] == accepted["CPU_ATTN"], accepted


def test_rerank_reads_each_backends_cache(tiny_llama, monkeypatch):
    """rerank's exact stage reads keys from vLLM's KV cache: CPU_ATTN's ISA-packed layout and
    FLEX's logical one (engine/paged_keys.py). Each reader passed its check against the
    captured keys (a reader that fails it is dropped: None would be recorded), and the two
    backends' selections agree: the same acceptance, greedy identical to plain vLLM."""
    calls = record_rerank_calls(monkeypatch)
    accepted = {}
    for backend, layout in zip(BACKENDS, ("cpu_transposed", "logical")):
        calls.clear()
        tokens, stats = run(tiny_llama, backend, two_level("rerank"))
        assert tokens == run(tiny_llama, backend)[0]
        assert_drafted(stats)
        sources = [args[3] for args in calls]
        assert sources and {getattr(s, "layout", None) for s in sources} == {layout}
        assert all(s.checked for s in sources)
        accepted[backend] = (stats["top_accepted"], stats["top_proposed"])
    print(f"rerank full-cache acceptance (accepted, proposed): {accepted}")
    assert accepted["FLEX_ATTENTION"] == accepted["CPU_ATTN"], accepted
