"""`vllm-triforce demo --state-dir`: the engines one after another, each engine's results
kept in the folder as its part ends, so that a run a time limit cuts (a lent GPU's call)
resumes at the first part without results. The engines here are fakes answering the
demo's commands in this process (the real ones are child processes: tests/test_demo.py),
so each test sees which engines the demo started and what it did with their answers."""

import argparse
import json

import pytest

from vllm_triforce.tools import demo

PROMPTS = [{"prompt_token_ids": list(range(16))}, {"prompt_token_ids": list(range(16, 32))}]
SPEC = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 512}
TOKENS = [[1, 2, 3, 4], [5, 6, 7, 8]]


def counts(proposed: int, accepted: int) -> dict:
    return {"top_proposed": proposed, "top_accepted": accepted, "middle_proposed": 0,
            "middle_accepted": 0, "depth_counts": [4, 0, 0, 0, 0, 0, 2], "plain_steps": 4,
            "drafting_steps": 1, "middle_seconds": 0.01, "middle_rounds": 6,
            "forward_seconds": 0.005}


class FakeEngine:
    """Answers `decode`, `fixed` and `margins` as demo_engine.py's process does; `fail_on`:
    the command number (from 1) that fails, as a call cut by its time limit would."""

    def __init__(self, name: str, tok_s: float, fail_on: int | None = None):
        self.name, self.tok_s, self.fail_on, self.asked = name, tok_s, fail_on, 0

    def answer(self, command: str):
        self.asked += 1
        if self.asked == self.fail_on:
            raise RuntimeError(f"{self.name} cut at its command {self.asked}")
        if command == "margins":
            return [[1.0] * 4 for _ in TOKENS]
        run = {"tokens": TOKENS, "prefill_s": 0.1, "decode_s": 0.5,
               "tok_s": self.tok_s + self.asked, "metrics": {}, "text": "Call me Ishmael."}
        if self.name != "plain":
            run["triforce"] = counts(12, 10) if command == "fixed" else counts(0, 0)
        return run


@pytest.fixture
def fakes(monkeypatch):
    """Which engines the demo starts, in order; `fail[name]`: the command that fails."""
    started, fail = [], {}

    def start(context, model_dir, spec, prompts, args, eager_only=False):
        name = "plain" if spec is None else ("eager" if eager_only else "triforce")
        started.append(name)
        engine = FakeEngine(name, {"plain": 100.0, "triforce": 90.0, "eager": 30.0}[name],
                            fail.get(name))
        return None, engine, {"mode": "eager" if eager_only else "compiled", "prefill_s": 0.1}

    monkeypatch.setattr(demo, "_start", start)
    monkeypatch.setattr(demo, "_ask", lambda conn, command: conn.answer(command))
    monkeypatch.setattr(demo, "_stop", lambda proc, conn: None)
    return started, fail


def demo_args(tmp_path, device="cpu") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_demo_parser(parser.add_subparsers())
    args = parser.parse_args([
        "demo", "--device", device, "--state-dir", str(tmp_path / "state"), "--rounds", "2",
        "--eager-check", "--prompt-tokens", "16", "--batch", "2", "--max-tokens", "4",
        "--log", str(tmp_path / "vllm.log"), "--out", str(tmp_path / "results.json")])
    return demo.resolve_device(args)


def run(tmp_path, spec=SPEC, device="cpu"):
    return demo._run(tmp_path / "smollm2-135m", spec, PROMPTS, demo_args(tmp_path, device),
                     demo.Clock(None))


def test_a_cut_run_resumes_at_the_engine_without_results(tmp_path, fakes):
    started, fail = fakes
    fail["triforce"] = 2  # the call ends in TriForce's second command
    with pytest.raises(RuntimeError, match="triforce cut"):
        run(tmp_path)
    assert started == ["plain", "triforce"]
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "state").iterdir())
    assert kept == ["plain"]  # plain's part ended and was kept; TriForce's did not
    partial = json.loads((tmp_path / "results.json").read_text())
    assert not partial["complete"] and len(partial["rounds"]["plain"]) == 2

    del fail["triforce"]
    started.clear()
    plain, tri, fixed = run(tmp_path)
    assert started == ["triforce", "eager"]  # plain vLLM's rounds came from the folder
    assert plain["round_tok_s"] == [101.0, 102.0]  # the first run's plain engine's
    assert tri["round_tok_s"] == [91.0, 92.0] and fixed["round_tok_s"] == [93.0]
    assert plain["tokens"] == tri["tokens"] == fixed["tokens"] == TOKENS
    assert fixed["triforce"]["top_proposed"] == 12
    assert fixed["eager_check"]["agree"] and fixed["eager_check"]["same_tokens"]

    started.clear()
    again = run(tmp_path)  # every part is in the folder: no engine starts
    assert started == []
    assert again[0]["round_tok_s"] == plain["round_tok_s"]
    assert again[2]["eager_check"] == fixed["eager_check"]


def test_plain_results_serve_every_triforce_variant_and_nothing_else_carries_over(
        tmp_path, fakes):
    started, _ = fakes
    run(tmp_path)
    started.clear()
    run(tmp_path, spec={**SPEC, "round_graphs": True})
    assert started == ["triforce", "eager"]  # another TriForce: its own parts, plain's kept
    started.clear()
    args = demo_args(tmp_path)
    args.max_tokens = 8  # other requests: nothing from the folder fits them
    demo._run(tmp_path / "smollm2-135m", SPEC, PROMPTS, args, demo.Clock(None))
    assert started == ["plain", "triforce", "eager"]


def test_on_a_gpu_each_triforce_round_decodes_at_full_depth_and_plain_keeps_its_margins(
        tmp_path, fakes):
    started, _ = fakes
    plain, tri, fixed = run(tmp_path, device="cuda")
    assert started == ["plain", "triforce", "eager"]
    assert len(fixed["round_tok_s"]) == 2 and plain["margins"] == [[1.0] * 4] * 2
    started.clear()
    plain_again, _, _ = run(tmp_path, device="cuda")
    assert started == [] and plain_again["margins"] == plain["margins"]
