"""Device syncs inside one `propose`: per middle round and per step outside the rounds (issue 25).

`SyncCounter` (vllm_triforce/syncs.py) is installed around every `TriForceProposer.propose`;
a *round* segment runs from the start of `MiddleLoop._round` to the start of the next one or
to the end of `MiddleLoop.run` (so it includes `select_in_middle` and the round's
bookkeeping); everything else in `propose` (StepBatch, commit, plan, select, the hand-off)
is the *step*. The engine is not changed: the test wraps its methods.

On a CPU-only machine every tensor is a "device" tensor, so host-side scalar reads (of the
StepBatch fields that `_to_host` copied) count too, and host-to-device `.to(device)` copies
are invisible (same device): CPU counts are what to remove to meet issue 25's rule "host
values are Python", not exactly GPU syncs.

TRIFORCE_SYNC_SITES=1 also prints, per case, the 15 engine lines with the most syncs (by
`traceback`, slow); TRIFORCE_SYNC_BATCHES picks the batch sizes. See the table with `-s`.
"""

import os

import pytest
import tiny_models
from engine_helpers import drafter_of, free_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

# today's counts; issue 25's target is <= 1 per round and <= 3 per step: lower these as the
# syncs go, never raise them. Key: (levels, temperature, batch) -> (max per middle round,
# max per step outside the rounds), counted on CPU (device_type "cpu"). Three levels' largest
# rounds are the small draft's re-bases (token ids read one by one, engine/batch.py).
RATCHET = {
    (2, 0.0, 1): (31, 46), (2, 1.0, 1): (37, 38), (2, 0.0, 8): (31, 124),
    (2, 1.0, 8): (37, 124), (2, 0.0, 32): (31, 321), (2, 1.0, 32): (37, 321),
    (3, 0.0, 1): (493, 47), (3, 1.0, 1): (503, 39), (3, 0.0, 8): (3185, 132),
    (3, 1.0, 8): (3195, 132), (3, 0.0, 32): (3853, 398), (3, 1.0, 32): (3867, 408),
}
# TRIFORCE_SYNC_BATCHES=1,8 (say) measures other batch sizes and only prints: the sampled
# cases share the engine's random stream, so their counts hold for this sequence of cases
DEFAULT_BATCHES = "1,8,32"
BATCHES = tuple(int(b) for b in os.environ.get("TRIFORCE_SYNC_BATCHES",
                                               DEFAULT_BATCHES).split(","))
MAX_TOKENS = 12
PROMPT_WORDS = 300  # ~450 tokens: beyond the retrieval budget (160) and the draft's window


class SyncRecorder:
    """One SyncCounter per `propose`, split at the middle rounds."""

    def __init__(self, monkeypatch, trace: bool = False):
        from vllm_triforce.engine.middle import MiddleLoop
        from vllm_triforce.engine.proposer import TriForceProposer
        from vllm_triforce.syncs import SyncCounter

        self.steps: list[SyncCounter] = []
        self.counter: SyncCounter | None = None
        propose, run, round_ = TriForceProposer.propose, MiddleLoop.run, MiddleLoop._round

        def counted_propose(proposer, *args, **kwargs):
            with SyncCounter(trace=trace) as self.counter:
                try:
                    return propose(proposer, *args, **kwargs)
                finally:
                    self.steps.append(self.counter)
                    self.counter = None

        def marked_round(loop, *args, **kwargs):
            self.counter.mark("round")
            return round_(loop, *args, **kwargs)

        def marked_run(loop, *args, **kwargs):
            try:
                return run(loop, *args, **kwargs)
            finally:
                self.counter.mark("step")

        monkeypatch.setattr(TriForceProposer, "propose", counted_propose)
        monkeypatch.setattr(MiddleLoop, "run", marked_run)
        monkeypatch.setattr(MiddleLoop, "_round", marked_round)

    def take(self) -> list:
        steps, self.steps = self.steps, []
        return steps


def summarise(steps) -> dict:
    rounds = [n for c in steps for n in c.counts_of("round")]
    per_step = [c.counts.get("step", 0) for c in steps]
    by_op = {"round": {}, "step": {}}
    for c in steps:
        for label, ops in c.by_label().items():
            for op, n in ops.items():
                by_op[label][op] = by_op[label].get(op, 0) + n
    sites = {"round": {}, "step": {}}  # label -> site -> hits
    for c in steps:
        for label, hits in c.sites.items():
            for site, n in hits.items():
                sites[label][site] = sites[label].get(site, 0) + n
    return {"max_round": max(rounds, default=0), "max_step": max(per_step, default=0),
            "num_rounds": len(rounds), "num_steps": len(steps),
            "mean_round": sum(rounds) / max(len(rounds), 1),
            "mean_step": sum(per_step) / max(len(per_step), 1), "by_op": by_op, "sites": sites}


def spec(levels: int, draft) -> dict:
    two = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
           "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32,
           "selection_policy": "retrieval", "refresh_interval": 16, "adaptive": False}
    if levels == 2:
        return two
    return {**two, "model": str(draft), "draft_window_tokens": 96, "draft_tokens_per_round": 2}


def measure(llm, recorder, temperature: float, batch: int) -> tuple[dict, dict]:
    from vllm import SamplingParams

    before = drafter_of(llm).stats.snapshot()
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [tiny_models.make_text(PROMPT_WORDS, seed=i) for i in range(batch)]
    recorder.take()
    llm.generate(prompts, params, use_tqdm=False)
    after = drafter_of(llm).stats.snapshot()
    drafted = {k: after[k] - before[k] for k in ("top_proposed", "middle_proposed")}
    return summarise(recorder.take()), drafted


@pytest.mark.parametrize("levels", [2, 3])
def test_syncs_per_round_and_per_step_stay_under_the_ratchet(levels, tiny_llama, tiny_draft,
                                                             monkeypatch):
    from vllm import LLM

    from vllm_triforce.syncs import default_device_type

    trace = os.environ.get("TRIFORCE_SYNC_SITES") == "1"
    recorder = SyncRecorder(monkeypatch, trace=trace)
    llm = LLM(str(tiny_llama), speculative_config=spec(levels, tiny_draft),
              **make_engine_kwargs(enable_prefix_caching=False))  # cases do not share prefills
    try:
        results = {(levels, t, b): measure(llm, recorder, t, b)
                   for b in BATCHES for t in (0.0, 1.0)}
    finally:
        free_llm(llm)
    print(f"\nsyncs per propose, {levels} levels ({default_device_type()}): "
          "case | max/round | max/step | mean/round | mean/step | rounds | steps | by op")
    for key, (s, _) in results.items():
        print(f"{key} | {s['max_round']} | {s['max_step']} | {s['mean_round']:.1f} | "
              f"{s['mean_step']:.1f} | {s['num_rounds']} | {s['num_steps']} | {s['by_op']}")
        for label, hits in s["sites"].items() if trace else ():
            top = sorted(hits.items(), key=lambda kv: -kv[1])[:15]
            print(f"  top sites, {label} (hits over {s['num_' + label + 's']} {label}s):")
            print("\n".join(f"    {n:6d}  {site}" for site, n in top))
    for key, (s, drafted) in results.items():
        assert drafted["top_proposed"] > 0 and s["num_rounds"] > 0, f"{key}: never drafted"
        if levels == 3:
            assert drafted["middle_proposed"] > 0, f"{key}: the small draft never proposed"
    if default_device_type() != "cpu":
        pytest.skip("the ratchet holds CPU counts; GPU counts printed above")
    if BATCHES != tuple(int(b) for b in DEFAULT_BATCHES.split(",")):
        pytest.skip("TRIFORCE_SYNC_BATCHES set: counts printed, the ratchet not checked")
    over = {key: ((s["max_round"], s["max_step"]), RATCHET[key], s["by_op"])
            for key, (s, _) in results.items()
            if key in RATCHET
            and (s["max_round"] > RATCHET[key][0] or s["max_step"] > RATCHET[key][1])}
    assert not over, f"more syncs than the ratchet (measured, ratchet, by op): {over}"
