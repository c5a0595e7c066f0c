"""Run benchmark jobs in child processes (`vllm_triforce.tools.bench.worker`), with progress.

`run_methods(job, runs, out_dir, isolate=True)` starts one child per run (memory is
freed between methods; an ngram engine cannot break the next engine). With
`isolate=False` all runs share one child (ngram last), which saves the ~10 s start-up
per run in `--quick` mode. `run_interleaved(job, runs, out_dir, rounds)` keeps one live
child per run, all at once, and has them take turns round by round, so that the host's
drift over a run falls on every method alike. Child logs go to
`<out_dir>/logs/<name>.log`, each child's results to `<out_dir>/logs/<name>.json`.
Children start with Intel OpenMP preloaded, as vLLM's CPU guide sets up
(vllm_triforce/tools/cpu_openmp.py); each result records the runtime its process ran on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from vllm_triforce.tools.cpu_openmp import with_intel_openmp

logger = logging.getLogger(__name__)


class BenchError(RuntimeError):
    """A benchmark child process failed; the message names its log file."""


def run_methods(job: dict, runs: list[dict], out_dir: Path, *, isolate: bool = True,
                desc: str = "bench") -> list[dict]:
    groups = [[run] for run in runs] if isolate else [runs]
    results: list[dict] = []
    with tqdm(total=len(runs), desc=desc, unit="run", file=sys.stderr) as bar:
        for group in groups:
            bar.set_postfix_str(",".join(r["name"] for r in group)[:40])
            results.extend(_run_child({**job, "runs": group}, out_dir, group[0]["name"]))
            bar.update(len(group))
    return results


def _run_child(job: dict, out_dir: Path, name: str) -> list[dict]:
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "vllm_triforce.tools.bench.worker", str(job_path),
                 str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                 env=with_intel_openmp(os.environ))
        if proc.returncode != 0 or not result_path.exists():
            tail = log_path.read_text().splitlines()[-15:]
            raise BenchError(f"run {name!r} failed (exit {proc.returncode}); log {log_path}:\n"
                             + "\n".join(tail))
        # Kept beside the log: a long run that fails later still leaves these results.
        (log_dir / f"{name}.json").write_text(result_path.read_text())
        return json.loads(result_path.read_text())


def run_interleaved(job: dict, runs: list[dict], out_dir: Path, rounds: int, *,
                    pause_s: float = 0.5, desc: str = "bench") -> list[dict]:
    """One result per row (a run, then its variants, as `run_methods` gives them), timed in
    `rounds` rounds by live children taking turns. Each run's child is started once, its
    engine prefilled and warmed up, while the others wait idle; then round i times every
    row once (`repeats` generations a turn), in the rows' order in even rounds and the
    reverse in odd ones (ABBA: over two rounds every row has the same mean position), with
    `pause_s` between turns so that a child's OpenMP threads are asleep when the next one
    starts. Two rows of a round are a few turns apart, not whole processes' runs, which is
    what makes their ratio round by round readable on a host whose speed drifts (the
    separate processes of `run_methods` differ by 7-30% on 2-vCPU hosts). Every engine is
    alive at once: the memory of all of them is needed."""
    children: list[_LiveChild] = []
    try:
        for run in tqdm(runs, desc=f"{desc}, starting", unit="engine", file=sys.stderr):
            children.append(_LiveChild({**job, "runs": [run]}, out_dir, run["name"]))
        turns = [(child, row) for child in children for row in range(child.num_rows)]
        with tqdm(total=rounds * len(turns), desc=desc, unit="turn", file=sys.stderr) as bar:
            for i in range(rounds):
                for child, row in turns if i % 2 == 0 else reversed(turns):
                    time.sleep(pause_s)
                    child.turn(row)
                    bar.update(1)
        return [result for child in children for result in child.finish()]
    finally:
        for child in children:
            child.kill()


class _LiveChild:
    """A worker child serving turns (bench/worker.py `serve_turns`): commands on its stdin,
    replies on a pipe of its own (vLLM logs to its stdout, which goes to the log file)."""

    def __init__(self, job: dict, out_dir: Path, name: str):
        log_dir = out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name, self.log_path = name, log_dir / f"{name}.log"
        self._tmp = tempfile.TemporaryDirectory()
        job_path = Path(self._tmp.name) / "job.json"
        self.result_path = Path(self._tmp.name) / "result.json"
        job_path.write_text(json.dumps(job))
        reply_read, reply_write = os.pipe()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_triforce.tools.bench.worker", str(job_path),
                 str(self.result_path), str(reply_write)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                pass_fds=(reply_write,), env=with_intel_openmp(os.environ))
        os.close(reply_write)
        self.replies = os.fdopen(reply_read)
        try:
            _ready, count = self._reply()
        except BaseException:
            self.kill()
            raise
        self.num_rows = int(count)

    def turn(self, row: int) -> None:
        self.proc.stdin.write(f"turn {row}\n")
        self.proc.stdin.flush()
        self._reply()

    def finish(self) -> list[dict]:
        self.proc.stdin.write("end\n")
        self.proc.stdin.close()
        code = self.proc.wait()
        if code != 0 or not self.result_path.exists():
            raise self._failed(code)
        (self.log_path.parent / f"{self.name}.json").write_text(self.result_path.read_text())
        return json.loads(self.result_path.read_text())

    def kill(self) -> None:
        """Whatever state it is in: its engine gone, its files removed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()
        self._tmp.cleanup()

    def _reply(self) -> list[str]:
        line = self.replies.readline()
        if not line:  # the child died
            raise self._failed(self.proc.wait())
        return line.split()

    def _failed(self, code: int) -> BenchError:
        tail = self.log_path.read_text().splitlines()[-15:]
        return BenchError(f"run {self.name!r} failed (exit {code}); log {self.log_path}:\n"
                          + "\n".join(tail))
