"""Capture each target attention layer's query and new keys, without copying model code.

Why a patch: TriForce scores KV blocks with the *current* post-RoPE query of every layer
and summarises blocks by their post-RoPE keys as written. vLLM 0.32 exposes neither (no
attention hook API; on CPU the cached K is stored in an ISA-packed layout, so reading it
back is backend-specific). Every backend's `AttentionImpl.forward(layer, query, key, value,
kv_cache, attn_metadata, output, ...)` (vllm/v1/attention/backend.py, 0.32.0) receives
both, so an instance-level wrapper on the *target* layers' impls sees them for any backend.

`apply()` only checks the interface exists; `install()` wraps the impls of one model's
layers when the TriForce proposer loads (each impl instance once). The wrapper keeps
references, never copies: the proposer consumes them right after the verification pass.
Under FULL CUDA graphs attention does not run Python (untested here; TriForce needs
eager or piecewise graphs, see README).
"""

import inspect

from vllm_triforce.patches import _util

NAME = "attention_capture"
TARGET = ("vllm.v1.attention.backend", "AttentionImpl.forward")
_EXPECTED = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")


def apply() -> None:
    _, _, forward = _util.resolve(*TARGET)
    params = tuple(inspect.signature(forward).parameters)
    if params[: len(_EXPECTED)] != _EXPECTED:
        raise RuntimeError(
            f"vllm-triforce: AttentionImpl.forward{params} no longer starts with {_EXPECTED}; "
            "the capture hook was written for vLLM 0.32.")
    _util.APPLIED[NAME] = True


class LayerCapture:
    """Holds, per target layer (in layer order), the last forward's query and key.

    queries[l]: [num_tokens, num_q_heads(, head_dim)]; keys[l]: [num_tokens, num_kv_heads(, head_dim)].
    Set `enabled = False` while running passes whose tensors must not be recorded.
    """

    def __init__(self, num_layers: int):
        self.queries: list = [None] * num_layers
        self.keys: list = [None] * num_layers
        self.enabled = True

    def clear(self) -> None:
        self.queries = [None] * len(self.queries)
        self.keys = [None] * len(self.keys)


def install(layers, capture: LayerCapture) -> None:
    """Wrap `layer.impl.forward` of each layer (ordered by layer index) to record into `capture`."""
    for index, layer in enumerate(layers):
        impl = layer.impl
        if getattr(impl.forward, _util.PATCHED_ATTR, False):
            continue
        impl.forward = _wrap_forward(impl.forward, index, capture)


def _wrap_forward(forward, index: int, capture: LayerCapture):
    def captured_forward(layer, query, key, value, *args, **kwargs):
        if capture.enabled:
            capture.queries[index] = query
            capture.keys[index] = key
        return forward(layer, query, key, value, *args, **kwargs)

    setattr(captured_forward, _util.PATCHED_ATTR, True)
    return captured_forward
