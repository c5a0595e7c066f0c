"""Record each target attention layer's query and new keys, without copying model code.

TriForce scores KV blocks with the *current* post-RoPE query of every layer and summarises
blocks by their post-RoPE keys as written. vLLM 0.32 exposes neither (no attention hook API;
on CPU the cached K is stored in an ISA-packed layout, so reading it back is backend-specific).
Every backend's `AttentionImpl.forward(layer, query, key, value, kv_cache, attn_metadata,
output, ...)` (vllm/v1/attention/backend.py, 0.32.0) receives both, so `install` wraps the
`forward` of the *target* layers' impl instances (each once) when the proposer loads: nothing
in vLLM changes at class level, which is why this lives here and not in `patches/`.

What is kept must still hold this pass's values when the proposer reads them, after the
verification pass. Under PIECEWISE CUDA graphs the query and key handed to the attention op
are outputs of the graph piece before it, in the graph memory pool that later pieces reuse
(vLLM keeps only weak references to piece outputs: vllm/compilation/cuda_graph.py): by the
time the proposer selects blocks, layer l's query could hold another layer's data, and
acceptance would collapse without a word (verification keeps outputs exact). So a pass of
at most `copy_tokens` tokens, the largest that vLLM may replay as a graph
(`max_cudagraph_capture_size`), is kept as copies; a larger pass never replays a graph and
is kept by reference, so a prefill chunk is never copied (or, `compact_large_passes`,
only its requests' last rows of queries are: the engine then needs none of its keys). The
copies cost two device copies per layer of a decode-sized pass
(benchmarks/explore/capture_copy.py measures them).
The same holds without CUDA graphs wherever attention runs inside one compiled graph:
vLLM's CPU compilation (DYNAMO_TRACE_ONCE with inductor, vllm/platforms/cpu.py) traces the
whole model into one inductor graph, and inductor's memory planning reuses a buffer once its
last use, the attention op, has run. A compiled CPU engine's prefill keys held by reference
held a later layer's values by the time the cache reader's check read them (layer 1 already
differed), and the summaries folded from them were as wrong. So where
`references_outlive_passes` says a reference may not hold (`copy_large_passes`), a larger
pass is copied too: every layer's query and key of a prefill chunk, or its compact rows.
Under FULL CUDA graphs attention does not run Python at all, so TriForce needs eager or
piecewise graphs (engine_settings.py), or, on Model Runner V2, FULL graphs only for the
passes it reads nothing of (engine/mrv2/graphs.py).

Persistent buffers (`CaptureBuffers`, with `round_graphs`): instead of a clone per pass, a
pass of at most the buffers' tokens is copied into [layers, tokens, width] tensors
allocated once, and what is kept is a view of them. A CUDA graph that records the pass
records the copy, so a replay refreshes the buffers as a clone never could. vLLM's passes
and TriForce's middle passes copy into buffers of their own (`LayerCapture.step_buffers`,
and the buffers a `recording(into=...)` names), so a middle round never overwrites the
queries and keys of vLLM's pass before the next step's commit has read them. A middle
pass keeps queries only: nothing reads a middle pass's keys.

Nothing is recorded when `attn_metadata` is None: that is a vLLM dummy run, not a step.
`GPUModelRunner._dummy_run` (vllm/v1/worker/gpu_model_runner.py, 0.32.0) builds metadata
only when `force_attention` or a FULL graph asks for it, and sets the forward context's
metadata to None otherwise, so the profile run (`profile_run`: up to max_num_batched_tokens
tokens, also the CPU runner's compile warm-up), piecewise graph captures and idle
data-parallel batches all reach `impl.forward` with None; every backend returns early on it
("Profiling run.", e.g. vllm/v1/attention/backends/flash_attn.py). Keeping those queries
and keys alive would inflate the peak memory vLLM measures before it sizes the KV cache.

Nor is a pass of vLLM's that TriForce will not read: a plain step's (engine/plain_steps.py:
nobody drafts, nothing is committed). `LayerCapture.reads_pass`, asked at the pass's first
layer, decides it from the host's facts before the pass, the same answer `propose` then
takes for the step; such a pass costs one call of that question, not a copy a layer.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch

PATCHED_ATTR = "__vllm_triforce_capture__"
# vLLM's default largest CUDA-graph size (CompilationConfig.max_cudagraph_capture_size),
# for configs that leave it unset (CPU): passes of at most this many tokens are copied.
DEFAULT_COPY_TOKENS = 512
_EXPECTED = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")


class CaptureBuffers:
    """Persistent copies of each target layer's query (and, with `keep_keys`, key) of a
    pass of at most `max_tokens` tokens: query [num_layers, max_tokens, width] in the dtype
    the attention receives, made at the first copy (an fp8 query stays fp8, see
    retrieval_level.dequantized_query) and never again unless that dtype or width changes.
    `put` copies one layer's tensor in and returns the view of its rows, shaped as given."""

    def __init__(self, num_layers: int, max_tokens: int, keep_keys: bool):
        self.num_layers, self.max_tokens, self.keep_keys = num_layers, max_tokens, keep_keys
        self.buffers: dict[str, torch.Tensor] = {}  # "query" / "key" -> [L, max_tokens, width]

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def put(self, name: str, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """tensor [n, ...] -> buffer[index, :n] holding a copy, viewed as tensor's shape."""
        width = tensor.shape[1:].numel()
        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != tensor.dtype or buffer.shape[-1] != width:
            buffer = torch.empty(self.num_layers, self.max_tokens, width, dtype=tensor.dtype,
                                 device=tensor.device)
            self.buffers[name] = buffer
        view = buffer[index, :tensor.shape[0]].view(tensor.shape)
        view.copy_(tensor)
        return view

    def layer_rows(self, name: str, num_tokens: int) -> "LayerRows":
        """The rows a pass of `num_tokens` tokens left in every layer's buffer (what a CUDA
        graph's replay refreshed without running Python)."""
        return LayerRows(self.buffers[name], num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class LayerRows:
    """Every layer's rows of one pass, in a `CaptureBuffers` buffer [L, max_tokens, width]:
    read as a list of per-layer views ([n, width] each, made when read), or, for a
    selection, the rows of every layer at once (`at`): one gather instead of a view per
    layer and a stack of them."""

    def __init__(self, buffer: torch.Tensor, num_tokens: int):
        self.buffer, self.num_tokens = buffer, num_tokens

    def __len__(self) -> int:
        return self.buffer.shape[0]

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, :self.num_tokens]

    def __iter__(self):
        return (self[layer] for layer in range(len(self)))

    def at(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] (device, each < num_tokens) -> [n, L, width], every layer's row."""
        return self.buffer[:, rows].transpose(0, 1)


class LayerCapture:
    """Holds, per target layer (in layer order), the last forward's query and key.

    queries[l]: [num_tokens, num_q_heads(, head_dim)];
    keys[l]: [num_tokens, num_kv_heads(, head_dim)].
    It records vLLM's own passes. The proposer reads them with recording `paused()`, so
    that its passes (the small draft's, the full-cache probe) leave them as they are, and
    has a retrieval pass, whose queries re-select blocks between middle rounds, record
    with `recording()`. `copy_tokens`: passes of at most this many tokens are kept as
    copies (see top).
    """

    def __init__(self, num_layers: int, copy_tokens: int = DEFAULT_COPY_TOKENS,
                 copy_large_passes: bool = False):
        self.queries: list = [None] * num_layers
        self.keys: list = [None] * num_layers
        self.copy_tokens = copy_tokens
        self._on = True  # switched only by `paused` and `recording`
        # vLLM's passes of at most copy_tokens tokens copy into these when set
        # (`use_step_buffers`); None: clones
        self.step_buffers: CaptureBuffers | None = None
        self._into: CaptureBuffers | None = None  # a `recording(into=...)` scope's buffers
        # `compact_large_passes`: a larger pass keeps its requests' last rows of queries
        # (`compact_rows` each) and the keys of its first `key_rows` rows, as copies
        self.compact_rows: int | None = None
        self.key_rows = 0
        self.compacted = False  # the last pass recorded was kept compact (`last_rows`)
        self._compact_when = None  # asked at each large pass's first layer
        self._compact_pass = False  # its answer for the pass being recorded
        # a pass larger than copy_tokens is copied too (`references_outlive_passes`)
        self.copy_large_passes = copy_large_passes
        # vLLM's FULL CUDA graphs (engine/mrv2/graphs.py): nothing of vLLM's is recorded
        # while a graph is being captured, so no copy is baked into every replay
        self.skip_while_capturing = False
        # asked at the first layer of each of vLLM's passes (None: never asked): whether
        # TriForce will read the pass. One it will not (a plain step's,
        # engine/plain_steps.py) is not recorded: no copy, nothing kept (`unread`)
        self.reads_pass = None
        self.unread = False  # the pass being run is vLLM's, and nothing reads it
        self._own = False  # inside `recording()`: TriForce's own pass

    def compact_large_passes(self, rows_per_request: int, key_rows: int,
                             when=None) -> None:
        """From now on, a pass of vLLM's larger than `copy_tokens` (a prefill chunk) keeps,
        instead of every layer's query and key by reference (which holds the whole pass's
        activations alive: 5.4 GB for a 16K-token chunk of Llama-3.1-8B), copies of each
        request's last `rows_per_request` query rows (all a selection reads: the newest
        committed token's, at most gamma2 rows before a request's last) and of its first
        `key_rows` rows of keys (the cache reader's check, engine/summary_keeper.py), or
        none with `key_rows` 0. For engines whose summaries are set from vLLM's KV cache
        (`SummaryKeeper.lazy`), which then reads a prefill's blocks back (`last_rows`
        maps a pass row to its kept row). `when`: asked at each large pass's first layer
        (None: always): whether that pass may be kept compact (the keeper's summaries may
        still be set from the cache: a benchmark may widen them after start-up)."""
        self.compact_rows, self.key_rows = rows_per_request, key_rows
        self._compact_when = when

    def use_step_buffers(self) -> CaptureBuffers:
        """vLLM's passes of at most `copy_tokens` tokens are kept in persistent buffers
        from now on, not as clones (module docstring). Once: a second call keeps them."""
        if self.step_buffers is None:
            self.step_buffers = CaptureBuffers(len(self.queries), self.copy_tokens,
                                               keep_keys=True)
        return self.step_buffers

    @property
    def is_recording(self) -> bool:
        return self._on

    def capturing_vllms_graph(self) -> bool:
        """A CUDA graph of vLLM's is being captured (`skip_while_capturing`): a pass outside
        TriForce's own `recording(into=...)`, under stream capture."""
        return self._into is None and torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def paused(self):
        """Nothing is recorded inside; the state before is restored on leaving."""
        with self._switched(False):
            yield self

    @contextlib.contextmanager
    def recording(self, into: CaptureBuffers | None = None):
        """Every target pass inside is recorded; the state before is restored on leaving.
        `into`: its queries go into these buffers (a middle pass's, keys not kept)."""
        before, self._into, own = self._into, into, self._own
        self._own = True
        try:
            with self._switched(True):
                yield self
        finally:
            self._into, self._own = before, own

    @contextlib.contextmanager
    def _switched(self, on: bool):
        before, self._on = self._on, on
        try:
            yield
        finally:
            self._on = before

    def record(self, index: int, query, key, query_start_loc=None) -> None:
        """Keep layer `index`'s query and key of this pass (module docstring);
        `query_start_loc` [R + 1] (device): the pass's requests, for `compact_large_passes`."""
        into = self._into
        if not isinstance(self.queries, list):  # a replay's `LayerRows`: a new pass begins
            self.queries = [None] * len(self.queries)
        if index == 0:
            self.unread = bool(into is None and not self._own and self.reads_pass is not None
                               and not self.reads_pass())
            if self.unread:  # the rest of the pass's layers skip `record` (`_wrap_forward`)
                self.clear()
                return
            self.compacted = False
            self._compact_pass = bool(
                self.compact_rows and query_start_loc is not None and into is None
                and query.shape[0] > self.copy_tokens
                and (self._compact_when is None or self._compact_when()))
        if into is not None:  # a middle pass: queries only, never in vLLM's pass's buffers
            if into.fits(query.shape[0]):
                query = into.put("query", index, query)
            elif query.shape[0] <= self.copy_tokens or self.copy_large_passes:
                query = query.clone()
            key = None
        elif query.shape[0] > self.copy_tokens:  # never a CUDA graph's: by reference, or
            if self._compact_pass:               # compact, or copied (`copy_large_passes`)
                query = query[self._kept_rows(query_start_loc, query.shape[0])]
                key = (key[:self.key_rows].clone() if key is not None and self.key_rows
                       else None)
                self.compacted = True
            elif self.copy_large_passes:
                query = query.clone()
                key = key.clone() if key is not None else None
        else:  # may be a graph replay's pool memory
            buffers = self.step_buffers
            if buffers is not None:
                query = buffers.put("query", index, query)
                key = buffers.put("key", index, key) if key is not None else None
            else:
                query = query.clone()
                key = key.clone() if key is not None else None
        self.queries[index] = query
        self.keys[index] = key

    def _kept_rows(self, query_start_loc, num_tokens: int) -> torch.Tensor:
        """[R * compact_rows] the rows a compact pass of `num_tokens` keeps: each request's
        last compact_rows rows, in order (rows before a short request's first are another
        request's, and never read). Example, rows 2, query starts [0, 3, 7]: rows
        [1, 2, 5, 6]. A backend may hand a longer, padded `query_start_loc` (FLEX: its
        persistent buffer): the first R + 1 entries are the pass's, and the rows kept for
        the padding, clamped into the pass, are never read."""
        ends = query_start_loc[1:].long()  # [R (+ padding)]
        back = torch.arange(self.compact_rows - 1, -1, -1, device=ends.device)
        return (ends[:, None] - 1 - back[None, :]).clamp_(0, num_tokens - 1).flatten()

    def last_rows(self, rows: np.ndarray, pass_rows: np.ndarray,
                  query_start_loc: list[int]) -> np.ndarray:
        """Where the queries of requests `rows` at rows `pass_rows` of the last pass are
        kept: the pass rows themselves, or in a compact pass (`compacted`) row
        r * compact_rows + (compact_rows - 1) - (its last row - pass row) of the kept ones;
        `query_start_loc` [R + 1] the pass's on the host. Example, rows 2, query starts
        [0, 3, 7]: request 1's row 6 is kept row 3, its row 5 kept row 2."""
        if not self.compacted:
            return pass_rows
        last = np.asarray(query_start_loc, dtype=np.int64)[np.asarray(rows) + 1] - 1
        back = last - pass_rows
        assert (back < self.compact_rows).all(), "a compact pass kept no such row"
        return np.asarray(rows) * self.compact_rows + self.compact_rows - 1 - back

    def take_views(self, buffers: CaptureBuffers, num_tokens: int) -> None:
        """Every layer's query is now `buffers`' first `num_tokens` rows (after a CUDA
        graph's replay, which copied them without running `record`), as one `LayerRows`;
        no keys."""
        self.queries = buffers.layer_rows("query", num_tokens)
        self.keys = [None] * len(self.keys)

    def clear(self) -> None:
        self.queries = [None] * len(self.queries)
        self.keys = [None] * len(self.keys)
        self.compacted = False


def install(layers, copy_tokens: int | None = None,
            copy_large_passes: bool = False) -> LayerCapture:
    """Wrap `layer.impl.forward` of each layer (ordered by layer index); returns the capture
    they record into. `copy_tokens`: the engine's `max_cudagraph_capture_size` (None: unset,
    DEFAULT_COPY_TOKENS); `copy_large_passes`: larger passes are copied too (see top)."""
    check_interface()
    capture = LayerCapture(len(layers), copy_tokens or DEFAULT_COPY_TOKENS, copy_large_passes)
    for index, layer in enumerate(layers):
        layer.impl.forward = _wrap_forward(_unwrapped(layer.impl.forward), index, capture)
    return capture


# dynamo backends that run the traced graph's operations one by one, each output its own
# allocation: nothing reuses an attention input's memory
EAGER_BACKENDS = ("eager", "aot_eager")


def references_outlive_passes(compilation_config, enforce_eager: bool) -> str:
    """'' when the query and key a layer's attention is handed keep their values after the
    forward (vLLM's CUDA graphs aside, which copy_tokens covers): an eager model, a dynamo
    backend that runs operations one by one, or vLLM's compilation split at the attention
    ops, whose pieces' outputs are fresh allocations. Otherwise why not: attention runs
    inside one compiled graph, whose memory planning reuses its inputs' buffers (top)."""
    from vllm.config import CompilationMode

    mode = compilation_config.mode
    if enforce_eager or mode == CompilationMode.NONE:
        return ""
    backend = compilation_config.backend or "inductor"
    if backend in EAGER_BACKENDS:
        return ""
    if (mode == CompilationMode.VLLM_COMPILE
            and compilation_config.splitting_ops_contain_attention()
            and not compilation_config.use_inductor_graph_partition):
        return ""
    return (f"attention runs inside one compiled graph (compilation mode "
            f"{getattr(mode, 'name', mode)}, backend {backend})")


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
        if (capture.is_recording and attn_metadata is not None  # None: a dummy run (see top)
                and (index == 0 or not capture.unread)  # a pass nothing reads: its first
                and not (capture.skip_while_capturing and capture.capturing_vllms_graph())):
            capture.record(index, query, key, getattr(attn_metadata, "query_start_loc", None))
        return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    captured_forward.__wrapped__ = forward
    setattr(captured_forward, PATCHED_ATTR, True)
    return captured_forward
