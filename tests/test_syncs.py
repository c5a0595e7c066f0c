"""Device syncs inside one `propose`: per middle round and per step outside the rounds.

`syncs.ProposeSyncs` installs a `SyncCounter` around every `TriForceProposer.propose` of the
engine and splits it into middle rounds and the rest of the step (its docstring); the same
counter gives `vllm-triforce bench speed` its syncs columns.

On a CPU-only machine every tensor counts as a device tensor: a scalar read of what would be
a host tensor on a GPU, or a blocking `.to(device)` of a tensor already there, counts too, so
meeting the target on a CPU means the engine follows its rule "host values are Python,
device values are tensors" (engine/device/transfer.py). On a CUDA machine the same test counts real
syncs (host-to-device copies are non-blocking from pinned memory there).

TRIFORCE_SYNC_SITES=1 also prints, per case, the 15 engine lines with the most syncs (by
`traceback`, slow); TRIFORCE_SYNC_BATCHES picks the batch sizes. See the table with `-s`.
"""

import os

import pytest
import tiny_models
from engine_helpers import drafter_of, free_llm, in_process_llm, make_engine_kwargs

pytestmark = pytest.mark.engine

# The target, met for every case: at most one sync per middle round (the copy of
# the accepted counts and tokens that decide the next round) and at most three per step
# outside the rounds (today one: StepBatch's copy of what vLLM's step decided). The
# KV-cache key reader's check at the engine's first commit is labelled "once" and printed.
# Reading host values from device tensors one by one (token ids on the small draft's
# re-bases, say) shows up here as tens to thousands per round.
MAX_PER_ROUND, MAX_PER_STEP = 1, 3
# TRIFORCE_SYNC_BATCHES=1,8 (say) measures other batch sizes and only prints: the sampled
# cases share the engine's random stream, so their counts hold for this sequence of cases
DEFAULT_BATCHES = "1,8,32"
BATCHES = tuple(int(b) for b in os.environ.get("TRIFORCE_SYNC_BATCHES",
                                               DEFAULT_BATCHES).split(","))
MAX_TOKENS = 12
PROMPT_WORDS = 300  # ~450 tokens: beyond the retrieval budget (160) and the draft's window


def spec(levels: int, draft) -> dict:
    two = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
           "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32,
           "selection_policy": "retrieval", "refresh_interval": 16, "adaptive": False}
    if levels == 2:
        return two
    return {**two, "model": str(draft), "draft_window_tokens": 96, "draft_tokens_per_round": 2}


def measure(llm, recorder, temperature: float, batch: int) -> tuple[dict, dict]:
    from vllm import SamplingParams

    from vllm_triforce.tools.bench.syncs import summarise

    before = drafter_of(llm).stats.snapshot()
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [tiny_models.make_text(PROMPT_WORDS, seed=i) for i in range(batch)]
    recorder.take()
    llm.generate(prompts, params, use_tqdm=False)
    after = drafter_of(llm).stats.snapshot()
    drafted = {k: after[k] - before[k] for k in ("top_proposed", "middle_proposed")}
    return summarise(recorder.take()), drafted


@pytest.mark.parametrize("levels", [2, 3])
def test_syncs_per_round_and_per_step_meet_the_target(levels, tiny_llama, tiny_draft):
    from vllm_triforce.tools.bench.syncs import ProposeSyncs, default_device_type

    trace = os.environ.get("TRIFORCE_SYNC_SITES") == "1"
    llm = in_process_llm(tiny_llama, spec(levels, tiny_draft),
                         **make_engine_kwargs(enable_prefix_caching=False))  # no shared prefills
    try:
        with ProposeSyncs(drafter_of(llm), trace=trace) as recorder:
            results = {(levels, t, b): measure(llm, recorder, t, b)
                       for b in BATCHES for t in (0.0, 1.0)}
    finally:
        free_llm(llm)
    print(f"\nsyncs per propose, {levels} levels ({default_device_type()}): "
          "case | max/round | max/step | mean/round | mean/step | rounds | steps | once | "
          "by op")
    for key, (s, _) in results.items():
        print(f"{key} | {s['max_round']} | {s['max_step']} | {s['mean_round']:.1f} | "
              f"{s['mean_step']:.1f} | {s['num_rounds']} | {s['num_steps']} | {s['once']} | "
              f"{s['by_op']}")
        for label, hits in ((k, s["sites"].get(k, {})) for k in ("round", "step")
                            if trace):
            top = sorted(hits.items(), key=lambda kv: -kv[1])[:15]
            print(f"  top sites, {label} (hits over {s['num_' + label + 's']} {label}s):")
            print("\n".join(f"    {n:6d}  {site}" for site, n in top))
    for key, (s, drafted) in results.items():
        assert drafted["top_proposed"] > 0 and s["num_rounds"] > 0, f"{key}: never drafted"
        if levels == 3:
            assert drafted["middle_proposed"] > 0, f"{key}: the small draft never proposed"
    over = {key: ((s["max_round"], s["max_step"]), s["by_op"])
            for key, (s, _) in results.items()
            if s["max_round"] > MAX_PER_ROUND or s["max_step"] > MAX_PER_STEP}
    assert not over, (f"more than {MAX_PER_ROUND} sync(s) per round or {MAX_PER_STEP} per step "
                      f"(measured, by op; TRIFORCE_SYNC_SITES=1 -s shows where): {over}")


def test_the_depth_controller_adds_no_device_sync(tiny_llama):
    """With the depth controller on (`adaptive`, the default), a step outside its rounds
    still meets the target: the controller plans on CPU tensors it builds itself, counted
    apart as "host" (no sync on a GPU; on this CPU every tensor counts)."""
    from vllm_triforce.tools.bench.syncs import ProposeSyncs

    llm = in_process_llm(tiny_llama, {**spec(2, None), "adaptive": True},
                         **make_engine_kwargs(enable_prefix_caching=False))
    try:
        with ProposeSyncs(drafter_of(llm)) as recorder:
            s, drafted = measure(llm, recorder, 0.0, 4)
    finally:
        free_llm(llm)
    print(f"\ncontroller: {s['max_round']}/round, {s['max_step']}/step, host {s['host']}")
    assert s["host"] > 0  # the controller planned (and its tensors were seen)
    assert s["num_rounds"] > 0 and drafted["top_proposed"] > 0  # and it drafted
    assert s["max_round"] <= MAX_PER_ROUND and s["max_step"] <= MAX_PER_STEP, s["by_op"]


def test_host_ops_counts_what_propose_dispatches_outside_the_model(monkeypatch):
    """tools/bench/host_ops.py (the GPU script's profile of a graphed round): every aten
    operation `propose` dispatches is counted with its host time, a pass's model's are not,
    and leaving restores the drafter and the engine's functions."""
    import torch

    from vllm_triforce.engine.device import forward
    from vllm_triforce.tools.bench.host_ops import HostOps

    def model_pass(x):  # stands for `forward.run`: its three operations are the model's
        return (x * 2 + 1).sum()

    monkeypatch.setattr(forward, "run", model_pass)

    class Drafter:
        def propose(self):
            x = torch.ones(4)  # 1 operation
            forward.run(x)
            return (x + 1).sum()  # 2 more

    drafter = Drafter()
    with HostOps(drafter) as ops:
        assert drafter.propose().item() == 8
    assert ops.total == 3, ops.counts
    assert ops.summary(rounds=1)["ops_per_round"] == 3
    assert "propose" not in vars(drafter) and forward.run is model_pass
