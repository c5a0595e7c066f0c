"""The algorithm core (and its benchmark) must not import vLLM."""

import subprocess
import sys


def test_core_does_not_import_vllm():
    code = ("import sys, vllm_triforce.core.selection, vllm_triforce.core.streaming, "
            "vllm_triforce.core.verify, vllm_triforce.core.refresh, "
            "vllm_triforce.tools.bench.selection_bench; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]")
    subprocess.run([sys.executable, "-c", code], check=True)
