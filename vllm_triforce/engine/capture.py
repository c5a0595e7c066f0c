"""Record each target attention layer's query and new keys, without copying model code.

TriForce scores KV blocks with the *current* post-RoPE query of every layer and summarises
blocks by their post-RoPE keys as written. vLLM 0.32 exposes neither (no attention hook API;
on CPU the cached K is stored in an ISA-packed layout, so reading it back is backend-specific).
Every backend's `AttentionImpl.forward(layer, query, key, value, kv_cache, attn_metadata,
output, ...)` (vllm/v1/attention/backend.py, 0.32.0) receives both, so `install` wraps the
`forward` of the *target* layers' impl instances (each once) when the proposer loads: nothing
in vLLM changes at class level, which is why this lives here and not in `patches/`.

The wrapper keeps references, never copies: the proposer consumes them right after the
verification pass. Under FULL CUDA graphs attention does not run Python, so TriForce needs
eager or piecewise graphs (engine_settings.py).

Nothing is recorded when `attn_metadata` is None: that is a vLLM dummy run, not a step.
`GPUModelRunner._dummy_run` (vllm/v1/worker/gpu_model_runner.py, 0.32.0) builds metadata
only when `force_attention` or a FULL graph asks for it, and sets the forward context's
metadata to None otherwise, so the profile run (`profile_run`: up to max_num_batched_tokens
tokens, also the CPU runner's compile warm-up), piecewise graph captures and idle
data-parallel batches all reach `impl.forward` with None; every backend returns early on it
("Profiling run.", e.g. vllm/v1/attention/backends/flash_attn.py). Keeping those queries
and keys alive would inflate the peak memory vLLM measures before it sizes the KV cache.
"""

from __future__ import annotations

import inspect

PATCHED_ATTR = "__vllm_triforce_capture__"
_EXPECTED = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")


class LayerCapture:
    """Holds, per target layer (in layer order), the last forward's query and key.

    queries[l]: [num_tokens, num_q_heads(, head_dim)];
    keys[l]: [num_tokens, num_kv_heads(, head_dim)].
    Set `enabled = False` while running passes whose tensors must not be recorded.
    """

    def __init__(self, num_layers: int):
        self.queries: list = [None] * num_layers
        self.keys: list = [None] * num_layers
        self.enabled = True

    def clear(self) -> None:
        self.queries = [None] * len(self.queries)
        self.keys = [None] * len(self.keys)


def install(layers) -> LayerCapture:
    """Wrap `layer.impl.forward` of each layer (ordered by layer index); returns the capture
    they record into."""
    check_interface()
    capture = LayerCapture(len(layers))
    for index, layer in enumerate(layers):
        layer.impl.forward = _wrap_forward(_unwrapped(layer.impl.forward), index, capture)
    return capture


def check_interface() -> None:
    """Refuse a vLLM whose `AttentionImpl.forward` no longer starts with the arguments read."""
    from vllm.v1.attention.backend import AttentionImpl

    params = tuple(inspect.signature(AttentionImpl.forward).parameters)
    if params[: len(_EXPECTED)] != _EXPECTED:
        raise RuntimeError(
            f"vllm-triforce: AttentionImpl.forward{params} no longer starts with {_EXPECTED}; "
            "the capture hook was written for vLLM 0.32.")


def _unwrapped(forward):
    """An impl already wrapped (a proposer re-loaded) is wrapped again from its original."""
    return forward.__wrapped__ if getattr(forward, PATCHED_ATTR, False) else forward


def _wrap_forward(forward, index: int, capture: LayerCapture):
    def captured_forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if capture.enabled and attn_metadata is not None:  # None: a dummy run (see top)
            capture.queries[index] = query
            capture.keys[index] = key
        return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    captured_forward.__wrapped__ = forward
    setattr(captured_forward, PATCHED_ATTR, True)
    return captured_forward
