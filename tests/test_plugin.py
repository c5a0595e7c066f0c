"""Plugin wiring: discovery, idempotent registration, the version gate, patches in effect,
and config errors that name the key before any weights load."""

import os
import subprocess
import sys

import pytest

import vllm_triforce
from vllm_triforce.config import ADDITIONAL_CONFIG_KEY, TriForceConfig, TriForceConfigError


def test_vllm_discovers_and_runs_register():
    code = ("import vllm.plugins as p; p.load_general_plugins(); import vllm_triforce as t; "
            "from vllm_triforce.patches import PATCH_MODULES, applied; "
            "print(t._registered, set(applied()) >= set(PATCH_MODULES), sorted(applied()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "VLLM_PLUGINS": "triforce"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("True True ['cli_args'")


def test_register_twice_is_harmless():
    from vllm.engine.arg_utils import EngineArgs

    vllm_triforce.register()
    first = EngineArgs.create_speculative_config
    vllm_triforce._registered = False  # force the second pass through every apply()
    vllm_triforce.register()
    assert EngineArgs.create_speculative_config is first
    assert first.__wrapped__.__name__ == "create_speculative_config"


def test_every_patch_took_effect():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_triforce.patches import PATCH_MODULES, _util, applied

    vllm_triforce.register()
    assert set(applied()) >= set(PATCH_MODULES)
    assert _util.is_patched(EngineArgs.create_speculative_config)
    assert _util.is_patched(GPUModelRunner.__init__)


@pytest.mark.parametrize("found", ["0.34.0", "0.31.2", "1.0.0"])
def test_version_gate_refuses_other_vllm(found):
    with pytest.raises(RuntimeError,
                       match=rf"supports vLLM 0\.32\.x or 0\.33\.x but found vLLM {found}"):
        vllm_triforce.check_vllm_version(found)
    vllm_triforce.check_vllm_version("0.32.0")
    vllm_triforce.check_vllm_version("0.32.1+cpu")
    vllm_triforce.check_vllm_version("0.33.0")


@pytest.mark.parametrize("spec, key", [
    ({"retrieval_budget": 1024, "gama": 3}, "gama"),
    ({"retrieval_budget": 64}, "retrieval_budget"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"selection_policy": "random"}, "selection_policy"),
    ({"refresh_acceptance_threshold": 2}, "refresh_acceptance_threshold"),
    ({"key_variance": "yes"}, "key_variance"),
    ({"compact_key_variance": 1}, "compact_key_variance"),
    ({"compact_summaries": "on"}, "compact_summaries"),
    ({"compact_summaries": True, "compact_key_variance": True}, "compact_summaries"),
    ({"compiled_selection": "yes"}, "compiled_selection"),
    ({"compiled_selection": True, "compact_summaries": False}, "compiled_selection"),
    ({"compiled_selection": True, "selection_policy": "quest"}, "compiled_selection"),
    ({"prefill_from_cache": "auto"}, "prefill_from_cache"),
    ({"compiled_sampling": "yes"}, "compiled_sampling"),
    ({"selection_graphs": 1}, "selection_graphs"),
    ({"selection_graphs": True, "round_graphs": True}, "selection_graphs"),
    ({"selection_graphs": True, "compiled_selection": True}, "selection_graphs"),
])
def test_config_errors_name_the_key(spec, key):
    with pytest.raises(TriForceConfigError, match=key):
        TriForceConfig.from_speculative_config({"method": "triforce", **spec})


def test_summaries_are_coded_on_a_gpu_unless_the_banded_variance_is_asked_for():
    """`compact_summaries` left out: coded on a GPU, float on a CPU (where float8 converts
    one value at a time) unless `compiled_selection`, whose kernels read the codes;
    `compact_key_variance` alone turns it off everywhere (its variance is banded, not
    coded); as set otherwise, on any device; the value survives the trip to the workers."""
    default = TriForceConfig()
    assert default.summary_kinds("cuda").coded and default.summary_kinds().coded
    assert not default.summary_kinds("cpu").coded
    assert TriForceConfig(compiled_selection=True).summary_kinds("cpu").coded
    assert TriForceConfig(compact_summaries=True).summary_kinds("cpu").coded
    banded = TriForceConfig(compact_key_variance=True)
    assert banded.compact_summaries is False and not banded.summary_kinds("cuda").coded
    assert banded.summary_kinds().compact_variance
    assert not TriForceConfig(compact_summaries=False).summary_kinds("cuda").coded
    for cfg in (default, banded):
        assert TriForceConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TriForceConfigError, match="compiled_selection"):
        TriForceConfig(compiled_selection=True, compact_summaries=False)


def test_prefills_are_read_back_from_the_cache_by_default_on_a_gpu_only():
    """`prefill_from_cache` left out: on with a CUDA device (vLLM's profile run sizes the
    KV cache there, and never sees a held prefill), off on a CPU (a fixed KV cache); as set
    otherwise, on any device."""
    default = TriForceConfig()
    assert default.prefill_from_cache is None
    assert default.prefill_from_cache_on("cuda") and not default.prefill_from_cache_on("cpu")
    assert TriForceConfig(prefill_from_cache=True).prefill_from_cache_on("cpu")
    assert not TriForceConfig(prefill_from_cache=False).prefill_from_cache_on("cuda")
    assert TriForceConfig.from_dict(default.to_dict()) == default


def _engine_config(model, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs

    vllm_triforce.register()
    return EngineArgs(model=str(model), speculative_config=spec, max_model_len=1024,
                      **kw).create_engine_config()


def test_triforce_config_reaches_vllm(tiny_llama, tiny_draft):
    config = _engine_config(tiny_llama, {"method": "triforce", "model": str(tiny_draft),
                                         "num_speculative_tokens": 5, "retrieval_budget": 512})
    spec = config.speculative_config
    assert spec.method == "draft_model" and spec.num_speculative_tokens == 5
    assert config.additional_config[ADDITIONAL_CONFIG_KEY]["retrieval_budget"] == 512
    assert TriForceConfig.from_vllm_config(config).retrieval_budget == 512
    # the draft's 256-position context does not cap the target or stop drafting
    assert spec.draft_model_config.max_model_len == config.model_config.max_model_len == 1024


def test_pipeline_parallel_refused(tiny_llama):
    with pytest.raises(TriForceConfigError, match="pipeline_parallel_size"):
        _engine_config(tiny_llama, {"method": "triforce", "retrieval_budget": 512},
                       pipeline_parallel_size=2)


def test_draft_with_other_vocabulary_refused(tiny_llama, tmp_path):
    import tiny_models

    other = tiny_models.build_tiny_llama_draft(tmp_path / "other")
    cfg = (other / "config.json")
    cfg.write_text(cfg.read_text().replace('"vocab_size": 512', '"vocab_size": 1024'))
    with pytest.raises(TriForceConfigError, match=r"\['model'\].*vocabulary"):
        _engine_config(tiny_llama, {"method": "triforce", "model": str(other),
                                    "retrieval_budget": 512})
