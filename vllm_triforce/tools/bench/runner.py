"""Run benchmark jobs in child processes (`vllm_triforce.tools.bench.worker`), with progress.

`run_methods(job, runs, out_dir, isolate=True)` starts one child per run (memory is
freed between methods; an ngram engine cannot break the next engine). With
`isolate=False` all runs share one child (ngram last), which saves the ~10 s
start-up per run in `--quick` mode. Child logs go to `<out_dir>/logs/<name>.log`, each child's results
to `<out_dir>/logs/<name>.json`. Children start with Intel OpenMP preloaded, as vLLM's CPU guide
sets up (vllm_triforce/tools/cpu_openmp.py); each result records the runtime its process ran on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
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
