"""The README's Serve block runs as written, and the CPU defaults that make it run.

`test_readme_serve_block_runs_as_written` extracts the fenced bash block under "### Serve"
and runs it verbatim from the repository root in a fresh environment (no
`VLLM_CPU_KVCACHE_SPACE`, no test settings): the commands before `vllm serve` and the
server in one background shell, the commands after it (the client) once the server is
healthy. So the README cannot rot again. The other tests pin `patches/cpu_defaults.py`:
the KV-cache size rule on hand-worked numbers, explicit choices left alone, the bf16
warning.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_serving_plumbing import stop_group, wait_healthy
from vllm_triforce.patches import cpu_defaults

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_SERVER_START_TIMEOUT_S = 600  # torch.compile warm-up: ~140 s on a loaded 2-core box
README_CLIENT_TIMEOUT_S = 300
MiB, GiB = 1 << 20, 1 << 30


# ------------------------------------------------------------------ the README block

def serve_block(text: str) -> list[str]:
    """Commands of the first ```bash block under "### Serve": continuation lines joined,
    comment lines dropped."""
    section = text.split("\n### Serve\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def split_at_server(commands: list[str]) -> tuple[list[str], str, list[str]]:
    """(commands before the server, the `vllm serve` command, commands after it)."""
    servers = [i for i, cmd in enumerate(commands) if re.search(r"\bvllm serve\b", cmd)]
    assert len(servers) == 1, f"expected one `vllm serve` command: {commands}"
    i = servers[0]
    return commands[:i], commands[i], commands[i + 1:]


def fresh_env() -> dict[str, str]:
    """A user's shell: this environment without any vLLM/TriForce setting the tests add
    (the engine env of conftest, the metrics directory) or HF offline switches; only
    VLLM_CACHE_ROOT stays (a per-session temp dir: a cold compile cache, like a new user)."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith(("VLLM_", "HF_")) and k != "VLLM_CACHE_ROOT")}


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_readme_serve_block_shape():
    before, server, after = split_at_server(serve_block(README.read_text()))
    assert "--host 127.0.0.1" in server  # the README server listens on loopback only
    assert re.search(r"--port \d+", server)
    assert after, "no client command after the server"


@pytest.mark.engine
def test_readme_serve_block_runs_as_written(tmp_path):
    before, server, after = split_at_server(serve_block(README.read_text()))
    port = int(re.search(r"--port (\d+)", server).group(1))
    if port_in_use(port):
        pytest.skip(f"port {port} (the README's) is busy on this machine")
    log = tmp_path / "server.log"
    env = fresh_env()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    with open(log, "w") as log_file:
        proc = subprocess.Popen(["bash", "-c", "\n".join(before + [server])], cwd=REPO,
                                env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        startup_s = wait_healthy(f"http://127.0.0.1:{port}", proc, log,
                                 README_SERVER_START_TIMEOUT_S)
        print(f"README server healthy after {startup_s:.1f} s")
        outputs = [subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, text=True,
                                  capture_output=True, timeout=README_CLIENT_TIMEOUT_S)
                   for cmd in after]
    finally:
        stop_group(proc)
    for cmd, out in zip(after, outputs):
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    client = outputs[-1].stdout
    assert "[completion, streamed] same text: True" in client
    assert "[chat, streamed] same text: True" in client
    drafts = [ln for ln in client.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0  # TriForce drafted
    server_log = log.read_text()
    assert "CPU KV cache: VLLM_CPU_KVCACHE_SPACE not set, using" in server_log
    assert "TriForce: 2 levels" in server_log
    # the compiled server's prefill keys are the cache's (engine/device/capture.py: one
    # inductor graph reused their memory, and the reader's check once failed here)
    assert "differ from the keys written" not in server_log


OFFLINE_SCRIPT = """
from vllm import LLM, SamplingParams
def main():
    llm = LLM(MODEL, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
              speculative_config={"method": "triforce", "num_speculative_tokens": 2,
                                  "retrieval_budget": 160})
    out = llm.generate(["The model"], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
    print("TOKENS", len(out[0].outputs[0].token_ids), flush=True)
if __name__ == "__main__":  # the engine core is a spawned child that re-imports this file
    main()
"""


@pytest.mark.engine
def test_offline_llm_runs_without_kv_space(tiny_llama, tmp_path):
    """`LLM(...)` as a user runs it (engine core in a child process, no
    VLLM_CPU_KVCACHE_SPACE): the front end picks the size and the child uses it."""
    script = tmp_path / "offline.py"
    script.write_text(f"MODEL = {str(tiny_llama)!r}\n{OFFLINE_SCRIPT}")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                         env=fresh_env(), text=True, capture_output=True,
                         timeout=README_CLIENT_TIMEOUT_S)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "TOKENS 8" in run.stdout
    assert "CPU KV cache: VLLM_CPU_KVCACHE_SPACE not set, using" in log
    assert re.search(r"Explicitly set \([\d.]+/[\d.]+\) GiB for KV cache", log)  # the worker


# ------------------------------------------------------------------ the KV-cache size rule

SMOL_FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head dim x fp32


@pytest.mark.parametrize("seqs, model_len, free, ranks, expected", [
    # demand: (4 x 256 tokens + vLLM's null block) x 45 KiB = 45.04 MiB -> 46, far below 4 GiB
    (4, 256, 8 * GiB, 1, (46 * MiB, "demand")),
    # `vllm serve` defaults: 128 x 8192 x 45 KiB = 45 GiB wanted, half of 7.7 GiB free given
    (128, 8192, int(7.7 * GiB), 1, (int(0.5 * 7.7 * GiB) // MiB * MiB, "free memory")),
    # two ranks on the node share the half
    (128, 8192, 8 * GiB, 2, (2 * GiB, "free memory")),
    # too little free for one 8192-token request (+ null block: 360.04 MiB): ask for it,
    # vLLM names the shortfall
    (128, 8192, 100 * MiB, 1, (361 * MiB, "one full-length request")),
])
def test_kv_cache_bytes_hand_worked(seqs, model_len, free, ranks, expected):
    assert cpu_defaults.kv_cache_bytes(SMOL_FP32_BYTES_PER_TOKEN, model_len, seqs, free,
                                       ranks) == expected


def test_kv_cache_bytes_holds_one_request_in_whole_blocks():
    """`bench serve` at concurrency 1: 2,128 tokens need 67 blocks of 32, plus vLLM's null
    block: 68 x 32 x 45 KiB = 95.6 MiB; 93 MiB (rounded down) and 95 MiB (no null block)
    both kept the server from starting."""
    size, bound = cpu_defaults.kv_cache_bytes(SMOL_FP32_BYTES_PER_TOKEN, 2128, 1, 8 * GiB, 1,
                                              block_size=32)
    assert bound == "demand" and size == 96 * MiB >= 68 * 32 * SMOL_FP32_BYTES_PER_TOKEN


class LogRecorder:
    def __init__(self):
        self.records: list[tuple[str, str]] = []

    def info(self, msg, *args):
        self.records.append(("info", msg % args))

    def warning_once(self, msg, *args):
        self.records.append(("warning", msg % args))


@pytest.fixture
def log_records(monkeypatch) -> list[tuple[str, str]]:
    recorder = LogRecorder()
    monkeypatch.setattr(cpu_defaults, "logger", recorder)
    return recorder.records


def engine_config(model, **kwargs):
    """A `VllmConfig` as `vllm serve` builds it (no engine, no weights)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(model=str(model), block_size=32, max_model_len=256, dtype="float32",
                      **kwargs)
    return args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def test_cpu_defaults_patch_took_effect():
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    from vllm_triforce.patches import _util, applied

    cpu_defaults.apply()
    assert applied().get("cpu_defaults")
    assert _util.is_patched(CpuPlatform.__dict__["check_and_update_config"].__func__)
    if not current_platform.is_cpu():
        pytest.skip("the KV default only changes CPU engines")


def test_kv_size_chosen_when_user_gave_none(tiny_llama, monkeypatch, log_records):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = engine_config(tiny_llama, max_num_seqs=4)
    per_token = cpu_defaults.kv_bytes_per_token(config)
    block = config.cache_config.block_size  # + vLLM's null block, rounded up to MiB
    assert config.cache_config.kv_cache_memory_bytes == -(-(4 * 256 + block) * per_token
                                                          // MiB) * MiB
    infos = [msg for level, msg in log_records if level == "info"]
    assert len(infos) == 1 and "VLLM_CPU_KVCACHE_SPACE not set" in infos[0]
    assert "demand bound: 4 seqs x 256 tokens" in infos[0]


@pytest.mark.parametrize("env, kwargs, expected", [
    ("2", {}, 2 * GiB),  # VLLM_CPU_KVCACHE_SPACE, in GiB
    (None, {"kv_cache_memory_bytes": 123 * MiB}, 123 * MiB),
    (None, {"gpu_memory_utilization": 0.5}, None),  # vLLM's fraction rule, as asked
])
def test_explicit_kv_choices_are_kept(tiny_llama, monkeypatch, log_records, env, kwargs,
                                      expected):
    if env is None:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", env)
    config = engine_config(tiny_llama, **kwargs)
    assert config.cache_config.kv_cache_memory_bytes == expected
    assert not [msg for level, msg in log_records if level == "info"]


class FakeModelConfig:
    def __init__(self, dtype):
        self.dtype, self.model = dtype, "/models/m"


@pytest.mark.parametrize("dtype, native, warns", [
    (torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False)])
def test_bf16_warning_only_when_emulated(monkeypatch, log_records, dtype, native, warns):
    monkeypatch.setattr(cpu_defaults, "bf16_is_native", lambda: native)
    assert cpu_defaults.warn_if_bf16_emulated(FakeModelConfig(dtype)) is warns
    warnings = [msg for level, msg in log_records if level == "warning"]
    assert len(warnings) == int(warns)
    if warns:
        assert "/models/m runs in bfloat16" in warnings[0] and "--dtype float32" in warnings[0]


def test_bf16_check_matches_bench_default():
    """The warning and `bench`'s default dtype ask the CPU the same question."""
    from vllm_triforce.tools.bench.cli import default_dtype

    if torch.cuda.is_available():
        pytest.skip("GPU: bench defaults to the checkpoint dtype regardless")
    assert (default_dtype() == "auto") == cpu_defaults.bf16_is_native()
