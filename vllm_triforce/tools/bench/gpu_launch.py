"""How `vllm-triforce bench gpu` (bench/gpu_check.py) runs one job: a child process of
bench/gpu_job.py with a timeout, its log appended to jobs.log, its outcome as a results.json
entry; and the record of the machine and versions each run was on.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_job(job: dict, out: Path, run_index: int, timeout_s: float) -> dict:
    """One child process; its log is appended to <out>/jobs.log (one file: the device
    sandbox brings back few files)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        partial = Path(tmp) / "partial.json"
        mirror = os.environ.get("VLLM_TRIFORCE_GPU_MIRROR")
        job_path.write_text(json.dumps({
            **job, "partial_path": str(partial),
            # kept current case by case where a killed run's files are fetched from
            "partial_mirror": str(Path(mirror) / "partial.json") if mirror else None}))
        log_path = Path(tmp) / "log"
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "vllm_triforce.tools.bench.gpu_job", str(job_path),
                     str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                    timeout=timeout_s, env=dict(os.environ))
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        text = log_path.read_text(errors="replace")
        for folder in (out, Path(mirror) if mirror else None):
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / "jobs.log", "a") as all_logs:
                    all_logs.write(f"\n===== {job['name']} (exit {code}, "
                                   f"{time.monotonic() - start:.0f} s) =====\n"
                                   f"{text[-200_000:]}")
        entry = {"status": "ok" if code == 0 and result_path.exists() else "failed",
                 "seconds": round(time.monotonic() - start, 1), "run": run_index,
                 "model_tag": job.get("model_tag")}
        if entry["status"] == "ok":
            entry["result"] = json.loads(result_path.read_text())
        else:
            entry["error"] = f"exit {code}: " + "\n".join(text.splitlines()[-25:])
            if partial.exists():
                entry["partial"] = json.loads(partial.read_text())
    print(f"bench gpu: {job['name']}: {entry['status']} in {entry['seconds']} s",
          file=sys.stderr, flush=True)
    return entry


def environment() -> dict:
    import torch

    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "cpu": _cpu_model(), "commit": _commit()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for name in ("vllm", "triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _commit() -> str | None:
    if os.environ.get("VLLM_TRIFORCE_COMMIT"):  # scripts/gpu_run.sh: a checkout without .git
        return os.environ["VLLM_TRIFORCE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None
