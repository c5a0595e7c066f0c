"""Teacher-forced acceptance: the target over each policy's cache against its full cache.

Walks real text. Documents of `C + P` tokens are prefilled by a two-level TriForce engine
(so the KV cache, the attention capture and the block summaries are filled by the engine's
own code), then the engine is paused with the requests live and, at every measured
position t = C + j (j < P, one row per document, one token per row):

  q_c = the target over column c's per-layer retrieval tables (`core/selection.py`,
        `core/tables.py`, from the column's scores), input = the text's token at t;
  p   = the target over its full table, same input.

Both run through `engine/device/forward.run_pass`, the one metadata builder the engine uses.
Every pass writes the token's KV into its real slot t; a q pass writes APPROXIMATE KV, so
all q passes at t run first and the full pass at t LAST: it reads only exact slots < t
plus its own slot (each layer writes before it attends) and rewrites slot t exactly, so
later positions see an exact prefix. Documents live in different blocks and never read
each other's slots.

Selection is the engine's: each column's `core.selection.Selector` (the object the
engine's retrieval level calls), scoring with the query of the newest committed token
(position t - 1, captured by the previous full pass), candidates = full blocks before
the tail, sinks + recent + the growing tail always kept. A column re-selects every
`refresh_every` positions from C on: 1 = at every position (the paper's Top-K oracle), the
engine's drafting depth = as the engine does (it re-selects at every drafting step, and a
step's drafts span at most num_speculative_tokens positions), 0 = once at C, kept for the P
positions (staleness 0..P-1: the engine's old 64-token refresh interval). A `middle_queries`
column also re-selects at the positions in between, as the engine does between middle
rounds: with the query its own retrieval pass computed at t - 1 (approximate), candidates
the blocks committed at the last full selection, re-ranking only the `shortlist` x
(retrieved blocks) best candidates of that selection per layer if `shortlist` > 0 (the
engine's `middle_shortlist`). Before C, `warmup` full passes
at positions C - warmup .. C - 1 give the query at C - 1 and the history H2O accumulates
(the engine's H2O observes one query per step between refreshes).

Depends on vLLM 0.32.0's in-process layout (`vllm_triforce/offline.py`) and on the
scheduler's `kv_cache_manager.get_block_ids` (vllm/v1/core/kv_cache_manager.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.scoring import SelectionState
from vllm_triforce.core.selection import Selection, Selector, Shortlist
from vllm_triforce.core import summary_coding
from vllm_triforce.core.summaries import COMPACT_BANDS, BlockSummaries
from vllm_triforce.core.tables import build_block_tables
from vllm_triforce.core.verify import sampling_probs


@dataclass
class Column:
    """One q per position: a selector (policy, geometry with the column's budget,
    shortlist factor, key source) and when it selects."""
    name: str
    selector: Selector
    refresh_every: int = 0  # positions between selections; 0: once per span
    middle_queries: bool = False  # in between: re-select with its own pass's query
    # score the key variance per band of channels (`compact_key_variance`) or rounded, and
    # the mean key rounded: the engine's per-channel store folded or coded as another store
    # would keep it; (profile, bands, element, mean element):
    # `TeacherForcedEngine.compact_summaries`'s arguments
    compact_variance: tuple[bool, int | None, str | None, str | None] | None = None
    # filled during a span
    selection: Selection | None = None
    states: list = field(default_factory=list)  # SelectionState per document (h2o)
    middle_query: torch.Tensor | None = None  # [D, L, Hq, Dh] from its last retrieval pass
    listed: Shortlist | None = None  # the last full selection's shortlist


@dataclass
class SpanResult:
    """Per column, one value per (document, position), documents outermost."""
    acceptance: dict[str, list[float]]  # sum_x min(p(x), q(x)) at temperature / top-p
    agreement: dict[str, list[bool]]    # argmax p == argmax q


class TeacherForcedEngine:
    """A paused two-level TriForce engine whose requests are teacher-forced documents."""

    def __init__(self, model: str, dtype: str, max_model_len: int, max_num_seqs: int,
                 kv_cache_gib: int | None = None, block_size: int = 32):
        from vllm_triforce.offline import drafter_of, in_process_llm
        from vllm_triforce.tools.bench.worker import ENGINE_ENV

        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        if kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        spec = {"method": "triforce", "num_speculative_tokens": 1,
                "retrieval_budget": 8 * block_size}  # the engine's own drafts are not measured
        self.llm = in_process_llm(model, spec, dtype=dtype, enforce_eager=True,
                                  block_size=block_size, seed=0, max_model_len=max_model_len,
                                  max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        self.drafter = drafter_of(self.llm)
        self.block_size = block_size
        # the engine's geometry; each column sets its own budget_blocks
        self.blocks: BlockCounts = self.drafter.shape.blocks
        layer = self.drafter.target_layers[0]
        self.num_q_heads, self.head_dim = layer.num_heads, layer.head_size
        self.summaries = self._widen_summaries()
        self._compact: dict = {}  # `compact_summaries`, until a prefill
        self._next_id = 0

    def _widen_summaries(self) -> BlockSummaries:
        """Give the engine's summaries every kind of block state any policy reads (means,
        bounds and a key copy) before any prompt, so its commit step fills them. In place:
        the engine's levels hold references to this object."""
        old = self.drafter.summaries
        wide = BlockSummaries(
            old.num_layers, old.num_blocks, old.num_kv_heads, old.head_dim, old.block_size,
            dtype=old.dtype, device=old.device, keep_keys=True, keep_bounds=True,
            keep_variance=True)
        vars(old).update(vars(wide))
        return old

    @property
    def num_blocks(self) -> int:
        return self.summaries.num_blocks

    def compact_summaries(self, profile: bool = True, bands: int | None = COMPACT_BANDS,
                          dtype: str | None = "bfloat16",
                          mean_dtype: str | None = None) -> BlockSummaries:
        """The summaries with their key variance folded into `bands` bands and rounded to
        `dtype` (`BlockSummaries.with_compact_variance`: what an engine with
        `compact_key_variance` and a bf16 KV cache keeps, up to the rounding of its own
        updates; `profile` False: without the channel profile), or (`bands` None) kept per
        channel and only rounded (None: exact); `mean_dtype`: the mean keys rounded too.
        A float8 element is scaled per layer, block and KV head (its largest magnitude to
        the format's largest). Made once per prefill: the measured passes fold nothing
        into the summaries."""
        key = (profile, bands, dtype, mean_dtype)
        if key not in self._compact:
            source = self.summaries
            if bands is not None:
                summaries = source.with_compact_variance(getattr(torch, dtype), profile, bands)
            else:
                summaries = BlockSummaries.__new__(BlockSummaries)
                vars(summaries).update(vars(source))
                summaries.square_deviations = _rounded(source.deviations(), dtype)
            if mean_dtype is not None:
                counts = source.counts.float().view(1, -1, 1, 1).clamp(min=1)
                summaries.sums = _rounded(source.sums.float() / counts, mean_dtype) * counts
            self._compact[key] = summaries
        return self._compact[key]

    def prefill(self, documents: list[list[int]]) -> tuple[list[str], torch.Tensor]:
        """Prefill the documents as live requests; returns their ids and block table
        [num_docs, max_blocks] int32 (physical ids, 0-padded)."""
        from vllm import SamplingParams

        self._compact = {}  # the summaries change
        needed = sum(-(-(len(doc) + 1) // self.block_size) for doc in documents)
        if needed > self.num_blocks - 1:  # vLLM keeps one null block
            raise RuntimeError(f"{len(documents)} documents need {needed} KV blocks, the cache "
                               f"has {self.num_blocks}: raise the KV cache size")
        params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        ids = []
        for doc in documents:
            ids.append(f"tf{self._next_id}")
            self._next_id += 1
            self.llm.llm_engine.add_request(ids[-1], {"prompt_token_ids": doc}, params)
        started: set[str] = set()
        while len(started) < len(ids):  # a request emits its first token once prefilled
            for out in self.llm.llm_engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
        return ids, self._block_table(ids)

    def _block_table(self, ids: list[str]) -> torch.Tensor:
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        internal = {rid.rsplit("-", 1)[0] if rid not in ids else rid: rid
                    for rid in scheduler.requests}
        rows = [scheduler.kv_cache_manager.get_block_ids(internal[i])[0] for i in ids]
        table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
        for r, blocks in enumerate(rows):
            table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    def release(self, ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(ids)

    def close(self) -> None:
        from vllm_triforce.offline import free_llm

        free_llm(self.llm)

    # ---- passes --------------------------------------------------------------------
    def _pass(self, tokens: list[int], t: int, block_table: torch.Tensor, tables,
              seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per document at position t; returns logits [num_docs, V]."""
        from vllm_triforce.engine.device.forward import build_pass, run_pass

        d = self.drafter
        inputs = build_pass([[token] for token in tokens], [[t]] * len(tokens), block_table,
                            self.block_size, seq_lens.tolist())
        groups = [g for per_kind in d.runner.attn_groups for g in per_kind]
        return run_pass(d.target_model, d.vllm_config, groups, inputs, tables,
                        limits=d.shape.pass_limits)

    def full_pass(self, tokens, t, block_table) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over its full table at t: (logits [D, V], query [D, L, Hq, Dh] of t)."""
        tables = dict.fromkeys(self.drafter.target_layer_names, block_table)
        seq_lens = torch.full((len(tokens),), t + 1, dtype=torch.int32)
        logits = self._pass(tokens, t, block_table, tables, seq_lens)
        return logits, self._queries(len(tokens))

    def _queries(self, num_docs: int) -> torch.Tensor:
        """[D, L, Hq, Dh] the last pass's queries (the engine's capture, copied)."""
        queries = [q.reshape(num_docs, self.num_q_heads, self.head_dim).float().clone()
                   for q in self.drafter.layer_capture.queries]
        return torch.stack(queries, dim=1)

    def retrieval_pass(self, tokens, t, block_table,
                       selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over a selection's per-layer tables at t: (logits [D, V], query
        [D, L, Hq, Dh] of t, approximate: computed over those tables)."""
        seq_end = torch.full((len(tokens),), t + 1, dtype=torch.long)
        tables, compact = build_block_tables(selection, block_table, seq_end, self.block_size)
        per_layer = {name: tables[l] for l, name in enumerate(self.drafter.target_layer_names)}
        logits = self._pass(tokens, t, block_table, per_layer, compact[0])
        return logits, self._queries(len(tokens))

    # ---- selection -----------------------------------------------------------------
    def select(self, column: Column, query: torch.Tensor, block_table: torch.Tensor,
               committed: int, middle: bool = False) -> Selection:
        """Column's selection for `committed` tokens; `middle`: between middle rounds (the
        column's shortlist, if it keeps one, is re-ranked instead of every candidate)."""
        num_committed = torch.full((query.shape[0],), committed, dtype=torch.long)
        summaries = (self.compact_summaries(*column.compact_variance)
                     if column.compact_variance else self.summaries)
        choice = column.selector.choose(query, summaries, block_table, num_committed,
                                        column.states or None,
                                        shortlist=column.listed if middle else None,
                                        keep_shortlist=not middle)
        if not middle:
            column.listed = choice.shortlist
        return choice.selection


def measure_span(engine: TeacherForcedEngine, documents: list[list[int]], context: int,
                 num_positions: int, columns: list[Column], warmup: int, temperature: float,
                 top_p: float, progress=None) -> SpanResult:
    """Measure every column at positions context .. context + num_positions - 1 of each
    document (each document is at least context + num_positions tokens)."""
    ids, block_table = engine.prefill(documents)
    try:
        _check_committed(engine, block_table, context + num_positions)
        return _walk(engine, documents, block_table, context, num_positions, columns,
                     warmup, temperature, top_p, progress)
    finally:
        engine.release(ids)


def _check_committed(engine: TeacherForcedEngine, block_table: torch.Tensor, length: int):
    """The engine's commit step summarised every prefilled full block (else the summaries
    would silently score empty blocks)."""
    full = block_table[:, :length // engine.block_size].long()
    counts = engine.summaries.counts[full]
    if not bool((counts == engine.block_size).all()):
        raise RuntimeError(f"block summaries incomplete after prefill: counts {counts.tolist()}")


def _walk(engine, documents, block_table, context, num_positions, columns, warmup,
          temperature, top_p, progress) -> SpanResult:
    num_docs = len(documents)
    temp = torch.full((num_docs,), temperature)
    top_ps = torch.full((num_docs,), top_p)
    h2o_like = [c for c in columns if c.selector.observes]
    for column in columns:
        column.selection = None
        column.listed = None
        column.states = [SelectionState() for _ in range(num_docs)] if column in h2o_like else []
    query = None
    for t in range(context - max(warmup, 1), context):  # exact rewrites: queries, history
        if query is not None:
            for column in h2o_like:
                column.selector.observe(query, engine.summaries, block_table,
                                        torch.full((num_docs,), t, dtype=torch.long),
                                        column.states)
        _, query = engine.full_pass([doc[t] for doc in documents], t, block_table)
    result = SpanResult({c.name: [] for c in columns}, {c.name: [] for c in columns})
    per_doc = {c.name: [[] for _ in range(num_docs)] for c in columns}
    agree_doc = {c.name: [[] for _ in range(num_docs)] for c in columns}
    for j in range(num_positions):
        t = context + j
        tokens = [doc[t] for doc in documents]
        q_logits = {}
        for column in columns:
            since = j % column.refresh_every if column.refresh_every else j
            if column.selection is None or (column.refresh_every and since == 0):
                column.selection = engine.select(column, query, block_table, t)
            elif column.middle_queries:  # as between middle rounds
                column.selection = engine.select(column, column.middle_query, block_table,
                                                 t - since, middle=True)
            q_logits[column.name], column.middle_query = engine.retrieval_pass(
                tokens, t, block_table, column.selection)
        p_logits, query = engine.full_pass(tokens, t, block_table)  # last: exact KV at t
        p = sampling_probs(p_logits, temp, top_p=top_ps)
        for name, logits in q_logits.items():
            q = sampling_probs(logits, temp, top_p=top_ps)
            acc = torch.minimum(p, q).sum(-1).tolist()
            agree = (logits.argmax(-1) == p_logits.argmax(-1)).tolist()
            for r in range(num_docs):
                per_doc[name][r].append(acc[r])
                agree_doc[name][r].append(agree[r])
        if progress is not None:
            progress(j + 1, num_positions)
    for column in columns:
        result.acceptance[column.name] = [x for doc in per_doc[column.name] for x in doc]
        result.agreement[column.name] = [x for doc in agree_doc[column.name] for x in doc]
    return result


def _rounded(x: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """x [..., D] float32 as stored in `dtype` and read back (None: x): float8 e4m3 and
    "log8" as the engine's coded summaries keep them (core/summary_coding.py, scaled per
    row of D: a layer's, block's and KV head's channels), wider floats rounded."""
    if dtype is None:
        return x
    if dtype == "log8":
        return summary_coding.rounded(x, "log8")
    element = getattr(torch, dtype)
    if element is summary_coding.FP8:
        return summary_coding.rounded(x, "fp8")
    if element.itemsize < 2:
        raise ValueError(f"no coding of the summaries keeps {dtype}")
    return x.to(element).float()
