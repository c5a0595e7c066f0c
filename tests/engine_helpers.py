"""Engine helpers shared by test modules (import these, not conftest: tests/core has its own)."""

from vllm_triforce.offline import drafter_of, free_llm, in_process_llm, runner_of  # noqa: F401
from vllm_triforce.tools.bench.forcing import schedule_depths  # noqa: F401

DEFAULT_MAX_MODEL_LEN = 1024
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"  # vLLM's counter of drafts verified


def make_engine_kwargs(**over) -> dict:
    """Deterministic, fast `vllm.LLM` kwargs for tiny CPU models; `over` wins."""
    kwargs = dict(dtype="float32", enforce_eager=True, block_size=32, seed=0,
                  max_model_len=DEFAULT_MAX_MODEL_LEN)
    kwargs.update(over)
    return kwargs


def fixed_depth_spec(budget: int, draft=None, **over) -> dict:
    """TriForce at a fixed depth of 4, re-selecting every round, with a retrieval budget of
    `budget` tokens (32 sink tokens, 64 recent): two levels, or with `draft` (a model
    folder) three, its window 96 tokens and 2 tokens a round; `over` wins."""
    spec = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": budget,
            "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64,
            "refresh_interval": 1, "adaptive": False}
    if draft is not None:
        spec.update(model=str(draft), draft_window_tokens=96, draft_tokens_per_round=2)
    return {**spec, **over}


def greedy_run(model, spec, prompts: list, max_tokens: int, engine: dict, read=None,
               **generate) -> tuple:
    """(greedy tokens of `prompts`, `max_tokens` each, TriForce's counters (None without
    `spec`: plain vLLM), `read(drafter)` taken before the engine goes) of an in-process
    engine over `model` with the `engine` keywords; `generate`: more of `LLM.generate`'s
    (e.g. `lora_request`)."""
    from vllm import SamplingParams

    llm = in_process_llm(model, spec, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stats = facts = None
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, **generate)
        if spec:
            drafter = drafter_of(llm)
            stats, facts = drafter.stats.snapshot(), read and read(drafter)
    finally:
        free_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], stats, facts


def assert_drafted(stats: dict, levels: int = 2) -> None:
    """TriForce drafted: vLLM's full-cache verification saw middle-level drafts
    (`top_proposed`) and, with three levels, the small draft proposed to the middle level
    (`middle_proposed`). Every identity or distribution test calls this on the TriForce
    engine's counters (`drafter_of(llm).stats.snapshot()`): an engine that never drafted
    decodes plainly, and equals plain vLLM trivially."""
    assert stats["top_proposed"] > 0, (
        f"TriForce never drafted: no draft reached vLLM's verification ({_depths(stats)})")
    if levels == 3:
        assert stats["middle_proposed"] > 0, (
            f"the small draft never proposed to the middle level ({_depths(stats)}, "
            f"{stats['top_proposed']} drafts verified, {stats['middle_rounds']} middle rounds)")


def assert_vllm_drafted(metrics: dict) -> None:
    """vLLM's own counter (`vllm:spec_decode_num_draft_tokens`, stats logging on) saw
    drafts: for engines whose TriForce counters this process cannot read (TP workers)."""
    drafted = metrics.get(VLLM_DRAFT_TOKENS) or 0
    assert drafted > 0, f"no draft token reached vLLM's verification ({VLLM_DRAFT_TOKENS} = " \
                        f"{metrics.get(VLLM_DRAFT_TOKENS)})"


def _depths(stats: dict) -> str:
    return (f"depth histogram {stats.get('depth_counts')}, plain steps "
            f"{stats.get('plain_steps')}, drafting steps {stats.get('drafting_steps')}")


def force_depths(llm, depths: list[int]) -> None:
    """The engine's depth controller plans `depths` in turn (`schedule_depths`): the
    adaptive path with depths that vary. For one depth without the controller's rules,
    the public call is `TriForceProposer.set_fixed_depth`."""
    schedule_depths(drafter_of(llm).depth.controller, depths)


def record_rerank_calls(monkeypatch) -> list[tuple]:
    """Wrap the selector's `rerank_exactly` (core/selection.py) so every call's arguments
    are appended to the returned list (args[0] the policy, args[3] the key source) before it
    runs as usual."""
    from vllm_triforce.core import selection

    calls = []
    exact = selection.rerank_exactly
    monkeypatch.setattr(selection, "rerank_exactly",
                        lambda *args: calls.append(args) or exact(*args))
    return calls


def watch_hand_off(llm) -> dict:
    """Check, at every step, that vLLM's rejection sampler gets, for each request it
    verifies, exactly the draft probabilities TriForce handed for that request (the compact
    buffer has a row per drafting request, which patches/handoff_rows.py names for vLLM).
    Returns counts, updated as the engine runs: `checked` (verifications compared) and
    `moved` (requests whose buffer row was not their batch row: the lookup mattered)."""
    import torch

    drafter = drafter_of(llm)
    runner = drafter.runner
    handed: dict[str, torch.Tensor] = {}
    seen = {"checked": 0, "moved": 0}
    propose, draft_probs = drafter.propose, runner._get_spec_decode_draft_probs

    def proposing(*args, **kwargs):
        out = propose(*args, **kwargs)
        probs, req_ids = drafter.take_last_draft_probs(), drafter.last_draft_prob_req_ids()
        handed.clear()
        if probs is not None:
            batch_rows = {req_id: i for i, req_id in enumerate(runner.input_batch.req_ids)}
            for i, req_id in enumerate(req_ids):
                handed[req_id] = probs[i].clone()
                seen["moved"] += batch_rows[req_id] != i
        return out

    def reading(spec_decode_metadata):
        got = draft_probs(spec_decode_metadata)
        expected = [handed[req_id][:n] for req_id, n in zip(
            runner.input_batch.req_ids, spec_decode_metadata.num_draft_tokens) if n]
        if expected:
            assert got is not None and torch.equal(got, torch.cat(expected)), \
                "vLLM read other draft probabilities than TriForce handed"
            seen["checked"] += 1
        return got

    drafter.propose, runner._get_spec_decode_draft_probs = proposing, reading
    return seen


def record_selections(drafter) -> list:
    """Every selection `drafter`'s retrieval level chooses from now on, as its logical
    blocks per layer (host lists), appended to the returned list: its Selector's `choose`
    is wrapped on the instance."""
    selector, selections = drafter.retrieval.selector, []
    choose = selector.choose

    def recording_choose(*args, **kwargs):
        choice = choose(*args, **kwargs)
        selections.append(choice.selection.logical_blocks.tolist())
        return choice

    selector.choose = recording_choose
    return selections

