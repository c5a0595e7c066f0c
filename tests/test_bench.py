"""`vllm-triforce bench speed|acceptance|sweep --quick` on a tiny random model: files
written, greedy outputs of every method identical to plain vLLM. (Each benchmark runs its
engines in one child process per group in --quick mode; acceptance runs its one engine
in this process.)"""

import json

import pytest

from engine_helpers import assert_drafted
from vllm_triforce.config import TriForceConfig
from vllm_triforce.tools import cli


def run_bench(kind: str, out, model, *extra: str) -> dict:
    """`vllm-triforce bench KIND --quick`; returns its results.json."""
    assert cli.main(["bench", kind, "--quick", "--out", str(out), "--model", str(model),
                     *extra]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.engine
def test_bench_speed_quick(tiny_llama, tmp_path):
    out = tmp_path / "speed"
    data = run_bench("speed", out, tiny_llama, "--methods", "plain", "triforce2",
                     "--dtype", "float32", "--policies", "rerank")
    # TriForce with its depth controller, then the same engine at the fixed depths 0 (always:
    # what a step without drafts costs) and 6, then the same with the policy asked for
    assert [r["method"] for r in data["rows"]] == [
        "plain", "triforce2", "triforce2 k=0", "triforce2 k=6", "triforce2 rerank",
        "triforce2 rerank k=0", "triforce2 rerank k=6"]
    raw = {r["name"]: r for r in data["raw"]}
    assert raw["triforce2"]["tokens"] == raw["triforce2 k=6"]["tokens"] == raw["plain"]["tokens"]
    for name in ("triforce2 k=0", "triforce2 rerank k=0"):  # forced plain: nothing drafted
        assert raw[name]["tokens"] == raw["plain"]["tokens"]
        assert raw[name]["triforce"]["top_proposed"] == 0
    assert raw["triforce2 rerank"]["tokens"] == raw["triforce2 rerank k=6"]["tokens"] \
        == raw["plain"]["tokens"]
    assert data["config"]["policies"] == ["rerank"]
    assert data["config"]["openmp"] == "Intel OpenMP"  # as vLLM's CPU guide sets up
    assert all(len(t) == 8 for t in raw["plain"]["tokens"])
    assert data["all_identical"] is True
    for name in ("triforce2 k=6", "triforce2 rerank k=6"):
        assert_drafted(raw[name]["triforce"])
        assert raw[name]["triforce"]["depth_counts"][6] > 0
    # The controller rows drafted too: until three verification steps are timed, the
    # controller probes drafting every few plain steps (core/controller.py), so 8 tokens
    # hold at least one drafting step (measured: 1 of 8 steps, 2 drafts).
    for name in ("triforce2", "triforce2 rerank"):
        print(f"{name} (controller): {raw[name]['triforce']}")
        assert_drafted(raw[name]["triforce"])
    rows = {r["method"]: r for r in data["rows"]}
    controller = rows["triforce2"]["controller"]  # its summary: depth 0 is not drafting
    assert sum(controller["depth_counts"][1:]) > 0 and rows["triforce2 k=6"]["controller"] is None
    assert rows["triforce2 k=0"]["cost_model"] is None  # no drafts: nothing to model
    cost = rows["triforce2 k=6"]["cost_model"]  # isolated step costs measured by the plain run
    assert cost["T1"] > 0 and cost["Tv"] > 0 and cost["Tm"] > 0 and cost["Tm_source"] == "isolated"
    assert cost["L"] >= 1 and cost["predicted_speedup"] > 0
    md = (out / "results.md").read_text()
    assert "achieved / predicted" in md and "dtype float32" in md
    assert "| triforce2 |" in md and "| triforce2 k=6 |" in md and "depth histogram" in md
    assert (out / "speed.png").read_bytes()[:4] == b"\x89PNG"


def test_speed_rounds_pair_each_round_with_its_own_plain_run():
    """--rounds: round i's speedup divides round i's plain time by round i's method time (a
    slow process for plain in one round must not decide the others); tokens that differ
    between rounds are not 'identical'."""
    from vllm_triforce.tools.bench.speed import merge_rounds, summarize

    def run(name, seconds, tokens=((1, 2),)):
        return {"name": name, "decode_s": [seconds], "tokens": [list(t) for t in tokens],
                "prefill_s": 1.0}

    rounds = [[run("plain", 2.0), run("tri", 1.0)], [run("plain", 3.0), run("tri", 2.0)],
              [run("plain", 2.0), run("tri", 1.0, tokens=((1, 3),))]]
    rows = summarize(merge_rounds(rounds), batch=1, max_tokens=10)
    assert rows[1]["round_speedups"] == [2.0, 1.5, 2.0]
    assert rows[1]["decode_s"] == 1.0  # median over all rounds' repeats
    assert rows[0]["identical"] and not rows[1]["identical"]


@pytest.mark.engine
def test_bench_speed_interleaved(tiny_llama, tmp_path):
    """--interleave: one live process per method taking turns, each row timed once a round,
    the same greedy tokens in every turn, each turn at its row's depth."""
    out = tmp_path / "speed"
    data = run_bench("speed", out, tiny_llama, "--methods", "plain", "triforce2",
                     "--dtype", "float32", "--rounds", "2", "--interleave")
    assert data["config"]["interleave"] is True and data["all_identical"] is True
    raw = {r["name"]: r for r in data["raw"]}
    assert list(raw) == ["plain", "triforce2", "triforce2 k=0", "triforce2 k=6"]
    for r in raw.values():
        assert len(r["decode_s"]) == 2 and len(r["round_decode_s"]) == 2  # 1 repeat a turn
        assert r["tokens"] == raw["plain"]["tokens"]
    # the second round runs k=0 right after k=6 (reversed order): its depth was set
    assert raw["triforce2 k=0"]["triforce"]["top_proposed"] == 0
    assert_drafted(raw["triforce2 k=6"]["triforce"])
    assert raw["triforce2 k=6"]["triforce"]["depth_counts"][6] > 0
    assert all(len(r["round_speedups"]) == 2 for r in data["rows"])
    assert "taken in turns by one live process per method" in (out / "results.md").read_text()
    assert sorted(f.name for f in (out / "logs").glob("*.json")) == ["plain.json",
                                                                  "triforce2.json"]


def test_interleaved_rounds_take_turns_abba(monkeypatch, tmp_path):
    """Round i times every row once, in order in even rounds and reversed in odd ones; every
    child is started before the first turn and finished (or killed) at the end."""
    from vllm_triforce.tools.bench import runner

    log = []

    class FakeChild:
        def __init__(self, job, out_dir, name):
            self.name, self.num_rows = name, len(job["runs"][0].get("variants", [])) + 1
            log.append(("start", name))

        def turn(self, row):
            log.append(("turn", self.name, row))

        def finish(self):
            return [{"name": f"{self.name}/{row}"} for row in range(self.num_rows)]

        def kill(self):
            log.append(("kill", self.name))

    monkeypatch.setattr(runner, "_LiveChild", FakeChild)
    runs = [{"name": "a"}, {"name": "b", "variants": [{"name": "b1"}]}]
    results = runner.run_interleaved({}, runs, tmp_path, rounds=3, pause_s=0)
    assert [r["name"] for r in results] == ["a/0", "b/0", "b/1"]
    turns = [entry[1:] for entry in log if entry[0] == "turn"]
    forward = [("a", 0), ("b", 0), ("b", 1)]
    assert turns == forward + forward[::-1] + forward
    assert log[:2] == [("start", "a"), ("start", "b")]
    assert log[-2:] == [("kill", "a"), ("kill", "b")]


def test_turns_merge_times_and_counters():
    """A row's turns as one result: every decode time, each turn's median, counters summed
    (the depth histogram element-wise, the decayed rate as the last turn left it), tokens
    None where one turn's differ."""
    from vllm_triforce.tools.bench.worker import merge_turns

    def turn(times, tokens=((1, 2),), proposed=3, depths=(1, 2), rate=5.0):
        return {"decode_s": list(times), "tokens": [list(t) for t in tokens],
                "vllm_spec": {"vllm:spec_decode_num_draft_tokens": proposed},
                "triforce": {"top_proposed": proposed, "depth_counts": list(depths),
                             "achieved_tokens_per_s": rate}}

    merged = merge_turns([turn([2, 3]), turn([4, 4], proposed=4, depths=(1, 0, 7), rate=6.0)])
    assert merged["decode_s"] == [2, 3, 4, 4] and merged["round_decode_s"] == [2.5, 4]
    assert merged["vllm_spec"] == {"vllm:spec_decode_num_draft_tokens": 7}
    assert merged["triforce"] == {"top_proposed": 7, "depth_counts": [2, 2, 7],
                                  "achieved_tokens_per_s": 6.0}
    assert merged["tokens"] == [[1, 2]]
    assert merge_turns([turn([1]), turn([1], tokens=((1, 3),))])["tokens"] is None


@pytest.mark.engine
def test_bench_acceptance_quick(tiny_llama, tmp_path):
    """Teacher-forced acceptance end to end; a sweep budget of 1024 tokens covers the whole
    512 + 8-token documents, so there every policy's q must be p exactly: that proves the
    per-layer tables and the exact rewrite of each measured slot."""
    from vllm_triforce.tools.bench.acceptance import COLUMNS, default_column

    out = tmp_path / "acc"
    data = run_bench("acceptance", out, tiny_llama, "--needle", "--budgets", "1024",
                     "--dtype", "float32")
    assert data["default_policy"] == default_column() == "retrieval_var_fp8_log"
    assert data["config"]["budget_tokens"] == 160  # 3% of 512 -> the minimum 5 blocks
    cells = data["cells"]
    assert {(c["task"], c["policy"]) for c in cells} == {
        (task, policy) for task in ("moby", "needle") for policy in COLUMNS}
    for cell in cells:
        assert set(cell) >= {"task", "policy", "acceptance", "ci95", "positions"}
        lo, hi = cell["ci95"]
        assert 0.0 <= cell["acceptance"] <= 1.0 + 1e-6 and lo <= cell["acceptance"] <= hi
        assert cell["positions"] == 32  # 4 documents x 8 positions
        assert 0.0 <= cell["greedy_agreement"] <= 1.0
    oracle = {c["task"]: c for c in cells if c["policy"] == "topk_oracle_per_position"}
    assert "minus_oracle" not in oracle["moby"] and "minus_streamingllm" in oracle["moby"]
    full = data["sweep"]
    assert {c["budget_tokens"] for c in full} == {1024} and {c["task"] for c in full} == {"moby"}
    for cell in full:
        assert abs(cell["acceptance"] - 1.0) < 1e-5, cell
        assert cell["greedy_agreement"] == 1.0, cell
    md = (out / "results.md").read_text()
    assert "## moby" in md and "## needle" in md and "budget sweep" in md
    for plot in ("acceptance.png", "budget_sweep.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


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


def test_bench_selection_takes_its_flags(capsys):
    """`vllm-triforce bench selection` passes its flags to the micro-benchmark (they were
    once swallowed by the subcommand's parser: `--tokens` was an unknown argument)."""
    from vllm_triforce.tools.bench import selection_bench

    assert cli.main(["bench", "selection", "--tokens", "256", "--layers", "2", "--budget", "224",
                     "--recent-blocks", "2", "--batch", "1", "--repeat", "1",
                     "--policies", "retrieval_var", "rerank"]) == 0
    out = capsys.readouterr().out
    assert "selection cost: 256 tokens, block 32, 2 layers, budget 224 tokens (1 sink + 2 recent" \
        in out
    for name in ("retrieval_var", "rerank"):
        assert out.count(f" {name} ") == len(selection_bench.SHAPES)
    assert " quest " not in out
