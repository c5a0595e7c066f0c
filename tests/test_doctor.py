"""`vllm-triforce doctor`: the report's verdicts on hand-made child results (every FAIL path,
the near-tie rule), a child that dies, and one real `--quick` run on SmolLM2 (CPU)."""

import copy

import pytest

from vllm_triforce.engine.stats import TriForceStats
from vllm_triforce.tools import cli, doctor

ENGINE = {"platform": "cpu", "device_type": "cpu", "vllm_version": "0.32.0",
          "cudagraph_mode": "NONE", "enforce_eager": True, "async_scheduling": False,
          "runner": "V1", "runner_class": "CPUModelRunner", "attention_backends": ["CPU_ATTN"],
          "drafter": "TriForceProposer", "reserved_bytes": 3 * 2**20,
          "key_reader": "checked (cpu_transposed)"}
STATS = {**TriForceStats().snapshot(), "middle_rounds": 12, "refreshes": 1, "top_proposed": 12,
         "top_accepted": 9}
PLAIN = {"tokens": [[5, 6, 7, 8]], "prefill_s": 1.0, "tok_s": 10.0, "logprobs": None,
         "engine": {**ENGINE, "drafter": "none"}, "vllm_spec": {}, "triforce": None}
TRI = {"tokens": [[5, 6, 7, 8]], "prefill_s": 1.2, "tok_s": 9.0, "logprobs": None,
       "engine": ENGINE, "triforce": STATS,
       "vllm_spec": {"vllm:spec_decode_num_draft_tokens": 12,
                     "vllm:spec_decode_num_accepted_tokens": 9}}


def _verdicts(plain=PLAIN, tri=TRI) -> dict[str, str]:
    return {c.item: c.status for c in doctor.evaluate(plain, tri)}


def _tri(**engine) -> dict:
    tri = copy.deepcopy(TRI)
    tri["engine"].update(engine)
    return tri


def test_healthy_results_pass():
    checks = doctor.evaluate(PLAIN, TRI)
    assert doctor.exit_code(checks) == 0
    assert {c.status for c in checks} == {"PASS", "INFO"}
    report = doctor.format_report(checks)
    assert "PASS  greedy identity" in report and "doctor: all checks passed" in report
    assert "3.0 MiB" in report  # the memory reservation, reported not judged
    assert "not judged on CPU" in report  # speed is INFO, with the reason


@pytest.mark.parametrize("engine, item", [
    ({"runner": "V2", "runner_class": "GPUModelRunner"}, "model runner"),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE", "enforce_eager": False}, "CUDA-graph mode"),
    ({"async_scheduling": True}, "async scheduling"),
    ({"attention_backends": ["FLASHMLA"]}, "attention backend"),
    ({"vllm_version": "0.34.0"}, "vLLM version"),
    ({"drafter": "DraftModelProposer"}, "TriForce proposer"),
    ({"key_reader": "check failed: layer 0's keys read from the logical layout differ"},
     "KV-cache key reader"),
])
def test_each_unsafe_setting_fails(engine, item):
    checks = doctor.evaluate(PLAIN, _tri(**engine))
    assert {c.item: c.status for c in checks}[item] == "FAIL"
    assert doctor.exit_code(checks) == 1
    assert "doctor: FAILED" in doctor.format_report(checks)


def test_tri_forces_model_runner_v2_binding_passes_with_the_settings_it_takes():
    """Model Runner V2 with TriForce's own runner (VLLM_TRIFORCE_MRV2=1 or
    VLLM_USE_V2_MODEL_RUNNER=1) passes, and so do FULL_AND_PIECEWISE and async scheduling,
    which that binding takes; FULL stays a failure there."""
    mrv2 = {"runner": "V2", "runner_class": "TriForceRunnerV2", "drafter": "TriForceSpeculator",
            "async_scheduling": True, "cudagraph_mode": "FULL_AND_PIECEWISE",
            "enforce_eager": False}
    checks = {c.item: c for c in doctor.evaluate(PLAIN, _tri(**mrv2))}
    for item in ("model runner", "CUDA-graph mode", "async scheduling", "TriForce proposer"):
        assert checks[item].status == "PASS", checks[item]
    assert "experimental" in checks["model runner"].detail
    full = {c.item: c for c in doctor.evaluate(PLAIN, _tri(**{**mrv2, "cudagraph_mode": "FULL"}))}
    assert full["CUDA-graph mode"].status == "FAIL"


def test_the_openmp_runtime_is_reported_on_cpu_with_the_fix_not_judged():
    gnu = {c.item: c for c in doctor.evaluate(PLAIN, _tri(openmp="GNU OpenMP"))}
    assert gnu["OpenMP runtime"].status == "INFO"
    assert "LD_PRELOAD=" in gnu["OpenMP runtime"].detail
    assert "libiomp5.so" in gnu["OpenMP runtime"].detail
    intel = {c.item: c for c in doctor.evaluate(PLAIN, _tri(openmp="Intel OpenMP"))}
    assert intel["OpenMP runtime"].detail == "Intel OpenMP"
    on_gpu = _verdicts(tri=_tri(openmp="GNU OpenMP", device_type="cuda"))
    assert "OpenMP runtime" not in on_gpu


def test_zero_acceptance_fails():
    tri = copy.deepcopy(TRI)
    tri["vllm_spec"]["vllm:spec_decode_num_accepted_tokens"] = 0
    assert _verdicts(tri=tri)["acceptance > 0"] == "FAIL"


def test_unreadable_kv_layout_is_reported_not_failed():
    checks = doctor.evaluate(PLAIN, _tri(key_reader="unreadable: CPU_ATTN's 'amx' ISA ..."))
    line = next(c for c in checks if c.item == "KV-cache key reader")
    assert line.status == "INFO" and "amx" in line.detail and "retrieval" in line.detail
    assert doctor.exit_code(checks) == 0


def test_missing_reservation_is_reported_not_failed():
    checks = doctor.evaluate(PLAIN, _tri(reserved_bytes=None))
    line = next(c for c in checks if c.item == "memory reservation")
    assert (line.status, line.detail.startswith("n/a")) == ("INFO", True)
    assert doctor.exit_code(checks) == 0


def test_different_tokens_fail_on_cpu():
    tri = copy.deepcopy(TRI)
    tri["tokens"] = [[5, 6, 9, 8]]
    checks = doctor.evaluate(PLAIN, tri)
    line = next(c for c in checks if c.item == "greedy identity")
    assert line.status == "FAIL" and "token 2: plain 7, TriForce 9" in line.detail
    assert doctor.exit_code(checks) == 1


@pytest.mark.parametrize("tri_logprob, status", [(-0.8, "PASS"), (-2.0, "FAIL"), (None, "FAIL")])
def test_gpu_divergence_passes_only_at_a_near_tie(tri_logprob, status):
    """Off CPU, a first divergence where plain vLLM's two choices are within NEAR_TIE_NATS
    is half-precision noise; a clear preference (or a token outside plain's top-k) is not."""
    step = {"7": -0.7} if tri_logprob is None else {"7": -0.7, "9": tri_logprob}
    plain = {**PLAIN, "logprobs": [[{"5": -0.1}, {"6": -0.1}, step, {"8": -0.1}]]}
    tri = _tri(device_type="cuda", platform="cuda: test", cudagraph_mode="PIECEWISE",
               enforce_eager=False, attention_backends=["FLASH_ATTN"])
    tri["tokens"] = [[5, 6, 9, 3]]
    assert _verdicts(plain, tri)["greedy identity"] == status


def test_crashed_triforce_child_fails():
    verdicts = _verdicts(tri={"error": "exit -6; log x.log"})
    assert verdicts == {"plain vLLM engine": "PASS", "TriForce engine": "FAIL"}


def test_child_that_dies_becomes_an_error(tmp_path):
    """A real child process that cannot build its engine: the parent gets the log tail."""
    job = {"model": str(tmp_path / "no-such-model"), "spec": None, "prompts": [[1, 2, 3]],
           "max_tokens": 2, "dtype": None, "max_model_len": 64}
    result = doctor._run_child(job, tmp_path / "child.log")
    assert result["error"].startswith("exit 1;") and "child.log" in result["error"]


@pytest.mark.engine
def test_quick_doctor_passes_on_cpu(smollm2, tmp_path, capsys):
    code = cli.main(["doctor", "--quick", "--model", str(smollm2),
                     "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out + (tmp_path / "triforce.log").read_text()[-3000:]
    for item in ("plain vLLM engine", "TriForce engine", "model runner", "async scheduling",
                 "attention backend", "TriForce proposer", "acceptance > 0",
                 "greedy identity", "KV-cache key reader"):
        assert f"PASS  {item}" in out, out
    assert "INFO  OpenMP runtime" in out, out  # the child's own, read from its maps
    assert "FAIL" not in out and "doctor: all checks passed" in out
