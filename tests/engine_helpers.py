"""Engine helpers shared by test modules (import these, not conftest: tests/core has its own)."""

from vllm_triforce.offline import drafter_of, free_llm  # noqa: F401

DEFAULT_MAX_MODEL_LEN = 1024


def make_engine_kwargs(**over) -> dict:
    """Deterministic, fast `vllm.LLM` kwargs for tiny CPU models; `over` wins."""
    kwargs = dict(dtype="float32", enforce_eager=True, block_size=32, seed=0,
                  max_model_len=DEFAULT_MAX_MODEL_LEN)
    kwargs.update(over)
    return kwargs


def record_rerank_calls(monkeypatch) -> list[tuple]:
    """Wrap the retrieval level's `rerank_exactly` so every call's arguments are appended to
    the returned list (args[0] the policy, args[3] the key source) before it runs as usual."""
    from vllm_triforce.engine import retrieval_level

    calls = []
    exact = retrieval_level.rerank_exactly
    monkeypatch.setattr(retrieval_level, "rerank_exactly",
                        lambda *args: calls.append(args) or exact(*args))
    return calls
