"""scripts/setup.sh (what `bash scripts/demo.sh` and `bash scripts/test.sh` run first) picks
the stack it installs: vLLM from PyPI where an NVIDIA GPU answers `nvidia-smi -L`, the CPU
build elsewhere, VLLM_TRIFORCE_STACK overriding. `--print-stack` says the choice and
installs nothing."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def stack(tmp_path, nvidia_smi: str | None, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        tool.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"  # no nvidia-smi of the machine's
    return subprocess.run(["bash", "scripts/setup.sh", "--print-stack"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": path, **env})


@pytest.mark.parametrize("nvidia_smi, expected", [
    ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'", "gpu"),
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2; "
     "exit 9", "cpu"),
    (None, "cpu"),
])
def test_the_stack_follows_the_gpu(tmp_path, nvidia_smi, expected):
    proc = stack(tmp_path, nvidia_smi, VLLM_TRIFORCE_STACK="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_the_stack_can_be_chosen_and_a_wrong_choice_is_refused(tmp_path):
    gpu = "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'"
    assert stack(tmp_path, gpu, VLLM_TRIFORCE_STACK="cpu").stdout.strip() == "cpu"
    assert stack(tmp_path, None, VLLM_TRIFORCE_STACK="gpu").stdout.strip() == "gpu"
    wrong = stack(tmp_path, None, VLLM_TRIFORCE_STACK="rocm")
    assert wrong.returncode == 2 and "VLLM_TRIFORCE_STACK must be cpu or gpu" in wrong.stderr
