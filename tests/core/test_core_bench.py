"""The selection micro-benchmark runs end to end (tiny shapes) and prints every policy."""

from vllm_triforce.core.policies import POLICIES
from vllm_triforce.tools.bench import selection_bench


def test_selection_bench_smoke(capsys):
    selection_bench.main(["--tokens", "256", "--layers", "2", "--budget", "224", "--batch", "1", "2",
                          "--repeat", "1"])
    out = capsys.readouterr().out
    for name in POLICIES:
        assert out.count(f" {name} ") == 2 * len(selection_bench.SHAPES)
    assert out.count("(attn/step)") == 2 * len(selection_bench.SHAPES)
