"""The algorithm core (and its benchmark) must not import vLLM."""

import subprocess
import sys


def test_core_does_not_import_vllm():
    code = ("import sys, vllm_triforce.core.selection, vllm_triforce.core.streaming, "
            "vllm_triforce.core.verify, vllm_triforce.core.refresh, "
            "vllm_triforce.tools.bench.selection_bench, "
            "vllm_triforce.tools.bench.selection_timing; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_line_parser_imports_no_torch():
    """`vllm-triforce` builds every subcommand's parser for any command, and set-up runs
    `models fetch` and `data fetch` three times: with torch imported at parse time (a
    benchmark module's top-level import) each took 5.3 s instead of 0.3 s on a 2-vCPU
    EPYC. Parsers stay light; handlers import torch and vLLM."""
    code = ("import sys\n"
            "from vllm_triforce.tools import cli\n"
            "cli.build_parser().parse_args(['data', 'list'])\n"
            "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
