"""`vllm-triforce bench speed|acceptance|sweep --quick` on a tiny random model: files
written, greedy outputs of every method identical to plain vLLM. (Each benchmark runs its
engines in one child process per group in --quick mode.)"""

import json

import pytest

from vllm_triforce import cli


def run_bench(kind: str, out, model, *extra: str) -> dict:
    """`vllm-triforce bench KIND --quick`; returns its results.json."""
    assert cli.main(["bench", kind, "--quick", "--out", str(out), "--model", str(model),
                     *extra]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.engine
def test_bench_speed_quick(tiny_llama, tmp_path):
    out = tmp_path / "speed"
    data = run_bench("speed", out, tiny_llama, "--methods", "plain", "triforce2",
                     "--dtype", "float32")
    assert [r["method"] for r in data["rows"]] == ["plain", "triforce2"]
    raw = {r["name"]: r for r in data["raw"]}
    assert raw["triforce2"]["tokens"] == raw["plain"]["tokens"]
    assert all(len(t) == 8 for t in raw["plain"]["tokens"])
    assert data["all_identical"] is True
    assert raw["triforce2"]["triforce"]["top_proposed"] > 0
    cost = data["rows"][1]["cost_model"]  # isolated step costs measured by the plain run
    assert cost["T1"] > 0 and cost["Tv"] > 0 and cost["Tm"] > 0 and cost["Tm_source"] == "isolated"
    assert cost["L"] >= 1 and cost["predicted_speedup"] > 0
    md = (out / "results.md").read_text()
    assert "achieved / predicted" in md and "dtype float32" in md
    assert "| triforce2 |" in md
    assert (out / "speed.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.engine
def test_bench_acceptance_quick(tiny_llama, tmp_path):
    out = tmp_path / "acc"
    data = run_bench("acceptance", out, tiny_llama, "--policies", "retrieval")
    assert set(data["table"]) == {"Moby-Dick", "SOTU needle"}
    assert data["config"]["temperature"] == 0.6  # the paper's setting by default
    for row in data["table"].values():
        cell = row["retrieval"]
        assert cell["proposed"] > 0 and cell["counters"]["top_proposed"] > 0
        assert 0.0 <= cell["acceptance"] <= 1.0
        assert cell["acceptance"] == cell["accepted"] / cell["proposed"]
        assert cell["middle_positions"] > 0 and 0.0 <= cell["middle"] <= 1.0 + 1e-6
        # a first draft vLLM accepted had sum min(p, q) > 0 at its (measured) position
        assert cell["middle"] > 0 or cell["accepted"] == 0
    md = (out / "results.md").read_text()
    assert "Σ min(p, q)" in md and "| Moby-Dick |" in md
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.engine
def test_bench_sweep_quick(tiny_llama, tmp_path):
    """Two knobs; plain vLLM runs once per (context, block, temperature), not per budget."""
    out = tmp_path / "sweep"
    data = run_bench("sweep", out, tiny_llama, "--knobs", "temperature", "budget")
    assert [p["value"] for p in data["temperature"]] == [0.0, 1.0]
    assert [p["value"] for p in data["budget"]] == [160, 224]
    assert data["temperature"][0]["identical"] is True  # greedy point
    assert data["temperature"][1]["identical"] == "n/a"
    for p in data["temperature"] + data["budget"]:
        assert p["plain_tok_s"] > 0 and p["triforce_tok_s"] > 0
        assert 0.0 <= p["acceptance"] <= 1.0
    logs = sorted(f.name for f in (out / "logs").glob("*.log"))
    assert sum("plain" in name for name in logs) == 2  # budget points reuse T=0's plain run
    for knob in ("temperature", "budget"):
        assert (out / f"sweep_{knob}.png").read_bytes()[:4] == b"\x89PNG"
