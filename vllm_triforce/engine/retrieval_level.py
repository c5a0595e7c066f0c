"""Level 2: the target over per-layer retrieval tables, and the block summaries it selects by.

Per step, after vLLM's full-cache verification pass: `commit` counts what vLLM accepted;
`select` re-scores the blocks of requests due for a refresh (core/selection.py,
core/refresh.py); each middle round then runs `forward`: the target over a different
compacted block table per layer, through the stock attention backend (zero-copy).

Block summaries, by default: a prompt's as it is computed, the rest lazily. A selection
scores only *full* committed blocks, so a block's summaries are needed only once it is full,
and then never change. A prefill pass (a prompt chunk, or a preempted request's recompute:
more tokens than a verification) folds its keys, which the capture holds in memory right
then, into the summaries (`BlockSummaries.add_committed`, by pieces of one read chunk);
the blocks it completes are recorded as set. Blocks completed while decoding are set just
before their request selects, from their keys read back from vLLM's KV cache
(engine/paged_keys.py, `BlockSummaries.set_blocks`). So a decode step in which nobody
selects (every plain step) does no per-layer TriForce work at all, and no prompt is ever
read back (lazily, a first selection would read a whole 8K prompt's keys from the cache
inside a decode step: measured, that cost most of the speedup at a KV-bound 8K shape).
Every committed token's key is folded at every step (eagerly) where the cache cannot be read
back exactly: no reader for the backend or ISA, a reader that failed its check, an fp8
cache (read back, its keys are rounded), or a policy that keeps its own copy of the keys or
observes every step (topk_oracle, h2o).

Terms. *committed*: positions whose KV is exact (written by vLLM's full-cache pass and
accepted). Selections are kept per request as logical blocks (engine/state.py).

Slots: vLLM reserves KV slots for `num_speculative_tokens` (= gamma2) lookahead positions; a
round never drafts past gamma2 middle tokens, so every pass here writes only slots inside that
reservation. Level-2 passes write approximate target KV into the real slots of not-yet-verified
positions; vLLM's next full pass rewrites those slots before they are read, and summaries only
ever take committed keys.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from vllm_triforce.core import reads
from vllm_triforce.core.blocks import selection_sizes
from vllm_triforce.core.selection import Selector
from vllm_triforce.core.summaries import committed_runs, token_pieces
from vllm_triforce.core.tables import TableLayout, laid_out_tables
from vllm_triforce.engine.block_contents import block_contents, common_prefix
from vllm_triforce.engine.buffers import fold_piece_tokens
from vllm_triforce.engine.forward import build_pass, run_pass
from vllm_triforce.engine.state import stacked, stacked_shortlist
from vllm_triforce.engine.transfer import to_device

logger = init_logger("vllm.triforce")


class RetrievalLevel:
    """The target (`model`, its attention layers `layer_names` in layer order, `attn_groups`)
    over retrieval tables that `selector` (core/selection.py: policy, geometry, shortlist,
    key source) chooses from `summaries` of the keys `capture` records. `num_heads`,
    `head_size`: the target's query heads, to read captured queries. The selector's key
    source, engine/paged_keys.py's reader of vLLM's KV cache (or None), is checked against
    the captured keys at the first commit whatever the policy (`key_status` says how that
    went: `vllm-triforce doctor` reports it); a reader that fails its check is dropped, so
    a two-stage policy (`rerank`) keeps its first stage alone."""

    def __init__(self, model, vllm_config, attn_groups, layer_names: list[str], num_heads: int,
                 head_size: int, capture, summaries, selector: Selector, refresh, stats, device):
        self.model = model
        self.vllm_config = vllm_config
        self.attn_groups = attn_groups
        self.layer_names = layer_names
        self.num_heads, self.head_size = num_heads, head_size
        self.capture = capture
        self.summaries = summaries
        self.selector = selector
        self.key_status = "not checked yet" if selector.keys is not None else "no reader"
        self.refresh = refresh
        self.blocks = selector.blocks
        self.paged_keys = selector.keys
        # Summaries of blocks completed while decoding set from the KV cache just before a
        # selection (see top); decided at the first commit, by the reader's check.
        self.lazy = False
        # physical block id -> content key (engine/block_contents.py) of the complete summaries
        # held there (set from the cache, or folded from every key of a prefill): a block
        # another request summarised (a prefix-cache hit) is not set again. A block a fold
        # touches without completing is dropped from it.
        self._summarised: dict[int, int] = {}
        self._summarised_rows: set[int] = set()  # rows whose blocks are set, this step
        # this step's time in `_summarise_full_blocks`: the blocks a request completed since
        # it last selected (after a plain stretch, all of that stretch's at once), so the
        # depth controller does not count it as a cost of drafting (engine/depth.py `end`)
        self.summarise_seconds = 0.0
        self.stats = stats
        self.device = device
        self._pass_queries: list | None = None  # per layer, the last `forward`'s queries

    # ---- commit ---------------------------------------------------------------------
    def commit(self, batch, states, judged_alone: bool) -> list[tuple[int, int, int]]:
        """Count what vLLM's verification accepted of last step's drafts and fold the keys
        that became final into the block summaries. `judged_alone`: the drafts were this
        level's own (no small draft), so they also count toward its refresh acceptance.
        Returns (row, drafts verified, accepted) for every request whose drafts were judged."""
        self._summarised_rows.clear()  # a new step: committed lengths and blocks moved
        self.summarise_seconds = 0.0
        verified, prefills = [], []
        for r in range(batch.num_reqs):
            if batch.q_lens[r] > 1 + states[r].last_num_drafts:
                prefills.append(r)  # more tokens than the drafts handed to vLLM could make
            # This pass verified our drafts iff it ran at most the drafts we handed vLLM last
            # step after the newest token (the scheduler may trim them); a prefill chunk does not.
            num_verified = batch.q_lens[r] - 1
            if 0 < num_verified <= states[r].last_num_drafts:
                accepted = num_verified - batch.num_rejected[r]
                verified.append((r, num_verified, accepted))
                self.stats.record_verification(num_verified, accepted)
                if judged_alone:
                    self.refresh.record_round(states[r].refresh, num_verified, accepted)
            states[r].last_num_drafts = 0
        self._fold_committed_keys(batch, states, prefills)
        return verified

    def _fold_committed_keys(self, batch, states, prefills: list[int]) -> None:
        """The keys this pass committed into the summaries: every request's (eagerly), or
        those of the prefill passes `prefills` (see top). At the first pass with keys, the
        cache reader is checked against them first; when it reads the cache exactly and
        nothing needs eager summaries, the engine folds prefills only from there on."""
        if self.capture.keys[0] is None:
            return
        reader = self.paged_keys
        if reader is not None and not reader.checked:  # once, at the first commit
            first = next(self._committed_tokens(batch, range(batch.num_reqs)), None)
            if first is None:
                return
            self._check_reader(reader, *first[:3])
            self.lazy = self.paged_keys is not None and self._lazy_possible()
        folded = prefills if self.lazy else range(batch.num_reqs)
        for committed in self._committed_tokens(batch, folded):
            fold_committed(self.summaries, self.capture.keys, committed)
        if self.lazy:
            self._record_folded_blocks(batch, states, prefills)

    def _record_folded_blocks(self, batch, states, prefills: list[int]) -> None:
        """After a fold of `prefills`' passes: the blocks each completed, every key of which
        was folded (by this pass, or by it and the request's prefill passes just before it,
        [state.eager_start, state.eager_end) the positions they folded), are recorded as set
        for their content; any other block the fold touched is forgotten (its summaries now
        hold part of a block). Host lists only.

        A run of folded positions goes on only from a prefill pass to the next chunk of the
        same prompt (where the pass starts is where the last ended): a decode step commits
        past the run's end, and a preempted request is recomputed from a block boundary
        (its prefix-cache hits, or 0), so no block a pass completes holds an unfolded key."""
        bs = self.blocks.block_size
        for r in prefills:
            state, start, end = states[r], batch.verify_start[r], batch.committed[r]
            if end <= start:
                continue
            if state.eager_end != start:  # a new run of folded positions begins
                state.eager_start = start
            state.eager_end = end
            first_full = -(-state.eager_start // bs)  # every key folded from here on
            ids = batch.requests[r].block_ids[0]  # vLLM's host copy, one KV group
            contents = block_contents(batch, r, state, end // bs, bs)
            for i in range(start // bs, -(-end // bs)):
                if first_full <= i < end // bs and contents is not None:
                    self._summarised[ids[i]] = contents[i]
                else:
                    self._summarised.pop(ids[i], None)

    def _committed_tokens(self, batch, rows):
        """Where the committed tokens of requests `rows` in this pass go, for
        `fold_committed`, in pieces of at most `fold_tokens()` tokens: (rows of the pass,
        physical block ids, offsets, (run of each token, number of runs)) each. Which
        rows, at which positions, in which runs of one block (core/summaries.py) are all
        known on the host, so the fold never waits for the device."""
        bs = self.blocks.block_size
        spans = [(r, batch.verify_start[r], batch.q_lens[r] - batch.num_rejected[r])
                 for r in rows]  # tokens committed by this pass
        for piece in token_pieces([span for span in spans if span[2] > 0],
                                  self.fold_tokens()):
            rows = [batch.query_start_loc[r] + p - batch.verify_start[r]
                    for r, first, n in piece for p in range(first, first + n)]
            # a request's new tokens fill its own blocks in order: one run per block
            positions, owners, runs, num_runs = committed_runs(piece, bs)
            rows, positions, owners, runs = to_device(self.device, rows, positions, owners,
                                                      runs)
            block_ids = batch.block_table[owners, positions // bs].long()
            yield rows, block_ids, positions % bs, (runs, num_runs)

    def fold_tokens(self) -> int:
        """Tokens folded at once (engine/buffers.py `fold_piece_tokens`; `fold_scratch_bytes`
        reserves the fold's copies)."""
        s = self.summaries
        return fold_piece_tokens(s.num_layers, s.num_kv_heads, s.head_dim,
                                 reads.read_limit(s))

    def _check_reader(self, reader, rows, block_ids, offsets) -> None:
        why = reader.check(self.capture.keys, rows, block_ids, offsets)
        self.key_status = f"check failed: {why}" if why else f"checked ({reader.layout})"
        if why:
            logger.warning("TriForce: keys read back from the KV cache differ from the keys "
                           "written (%s); `rerank` keeps its first stage only and block "
                           "summaries are folded eagerly. Please report this with your GPU "
                           "and attention backend.", why)
            self.selector.keys = self.paged_keys = None

    def _lazy_possible(self) -> bool:
        """Summaries set from the cache equal the eager ones (see top)."""
        return (self.paged_keys.fp8 is None and self.summaries.keys is None
                and not self.selector.observes)

    def _summarise_full_blocks(self, batch, states, rows: list[int]) -> None:
        """Lazy summaries: set those of requests `rows`' full committed blocks that are not
        set yet. Which are is the host's to know, so nothing syncs: a request's blocks are
        first compared by physical id with the ones it last saw set (a request recomputed
        into new blocks after preemption sets them again); any other block is skipped only
        when the summaries set at its physical id were set for the same content (same
        tokens after the same prefix: a prefix-cache hit on a block another request
        summarised). Reads at most one read chunk of keys at a time (`reads.read_limit`:
        SCORE_CHUNK_BYTES, or the memory plan's smaller one). A row done earlier
        in the step is not looked at again (committed tokens and blocks change only between
        steps; the middle rounds re-select up to once per round)."""
        rows = [r for r in rows if r not in self._summarised_rows]
        if not self.lazy or not rows:
            return
        self._summarised_rows.update(rows)
        start = time.perf_counter()
        try:
            self._set_missing_summaries(batch, states, rows)
        finally:
            self.summarise_seconds += time.perf_counter() - start

    def _set_missing_summaries(self, batch, states, rows: list[int]) -> None:
        """`_summarise_full_blocks`' work for `rows`."""
        bs = self.blocks.block_size
        owners, logical = [], []
        for r in rows:
            full = batch.committed[r] // bs
            ids = batch.requests[r].block_ids[0][:full]  # vLLM's host copy, one KV group
            state = states[r]
            done = common_prefix(state.folded_block_ids, ids)
            contents = block_contents(batch, r, state, full, bs) if done < full else None
            for i in range(done, full):
                content = None if contents is None else contents[i]
                if content is not None and self._summarised.get(ids[i]) == content:
                    continue  # set already, for this very content
                owners.append(r)
                logical.append(i)
                self._summarised[ids[i]] = content
            state.folded_block_ids = ids
        if not owners:
            return
        owners, logical = to_device(self.device, owners, logical)
        block_ids = batch.block_table[owners, logical].long()
        s = self.summaries
        # every layer's keys of a chunk of blocks, in float32, fill at most one read chunk
        per_chunk = max(1, reads.read_limit(s)
                        // (s.num_layers * s.num_kv_heads * bs * s.head_dim * 4))
        for start in range(0, block_ids.numel(), per_chunk):
            ids = block_ids[start:start + per_chunk]
            keys = torch.empty(s.num_layers, ids.numel(), s.num_kv_heads, bs, s.head_dim,
                               dtype=torch.float32, device=ids.device)
            for layer in range(s.num_layers):  # one read per layer: layers' caches are apart
                keys[layer].copy_(self.paged_keys.layer_keys(layer, ids))
            s.set_blocks(ids, keys)  # then every layer at once
        self.stats.add(summarised_blocks=block_ids.numel())

    # ---- select ---------------------------------------------------------------------
    def select(self, batch, states, rows: list[int]) -> None:
        """Re-select the blocks of requests due a refresh; the others' policies observe."""
        due = [r for r in rows
               if states[r].selection is None
               or self.refresh.should_refresh(states[r].refresh, batch.committed[r])]
        if self.capture.queries[0] is None:
            return
        rest = [r for r in rows if r not in due]
        self._summarise_full_blocks(batch, states, due)
        if rest and self.selector.observes:  # h2o accumulates (eager summaries)
            idx, query_rows, committed = to_device(
                self.device, rest, [batch.last_committed_row(r) for r in rest],
                [batch.committed[r] for r in rest])
            self.selector.observe(self._queries_at(self.capture.queries, query_rows),
                                  self.summaries, batch.block_table[idx], committed,
                                  [states[r].policy_state for r in rest])
        if due:
            self._reselect(batch, states, due, self.capture.queries,
                           [batch.last_committed_row(r) for r in due],
                           [batch.committed[r] for r in due], keep_shortlist=True)

    def select_in_middle(self, batch, states, rows: list[int], drafts_by_row) -> None:
        """Between middle rounds: requests `rows` due a refresh re-select with the query of
        their newest middle token (`drafts_by_row[r].query_row` of the pass `forward` just
        ran, at position `drafts_by_row[r].position - 1`; engine/middle.RequestDrafts).
        Called right after that pass, before any other target pass can reuse its buffers.
        Requests holding this step's shortlist re-rank only it; any other scores every
        candidate."""
        due = [r for r in rows
               if self.refresh.due_in_middle(states[r].refresh, drafts_by_row[r].position)]
        if not due or self._pass_queries is None:
            return
        self._summarise_full_blocks(batch, states, due)
        listed = [r for r in due if states[r].shortlist_committed == batch.committed[r]]
        rest = [r for r in due if r not in listed]
        for group, use_list in ((listed, True), (rest, False)):
            if group:
                self._reselect(batch, states, group, self._pass_queries,
                               [drafts_by_row[r].query_row for r in group],
                               [drafts_by_row[r].position for r in group],
                               use_shortlist=use_list)

    def end_rounds(self) -> None:
        """The step's middle rounds are over: free what they kept (the shortlists' copies)."""
        self.selector.release_copies()

    def _reselect(self, batch, states, due: list[int], layer_queries: list,
                  query_rows: list[int], prefixes: list[int], keep_shortlist: bool = False,
                  use_shortlist: bool = False) -> None:
        """Request due[i] re-selects with the query at row query_rows[i] of the pass whose
        per-layer queries are `layer_queries`: its token at position prefixes[i] - 1.
        Candidates are the committed full blocks either way. `keep_shortlist`: keep each
        layer's best candidates for this step's middle rounds; `use_shortlist`: score only
        those (every request in `due` holds this step's). The selection stays on the
        device; its sizes, which the host needs, follow from the committed length alone
        (core/blocks.selection_sizes)."""
        idx, query_rows, committed = to_device(self.device, due, query_rows,
                                               [batch.committed[r] for r in due])
        listed = (stacked_shortlist([states[r].shortlists for r in due],
                                    [states[r].shortlist_row for r in due])
                  if use_shortlist else None)
        choice = self.selector.choose(
            self._queries_at(layer_queries, query_rows), self.summaries, batch.block_table[idx],
            committed, [states[r].policy_state for r in due], shortlist=listed,
            keep_shortlist=keep_shortlist)
        # kept whole, each request pointing at its row: no operation per request
        logical, kept = choice.selection.logical_blocks, choice.shortlist
        for i, r in enumerate(due):
            st = states[r]
            if kept is not None:
                st.shortlists, st.shortlist_row = kept, i
                st.shortlist_committed = batch.committed[r]
            st.selection, st.selection_row = logical, i
            st.num_selected, st.tail_start = selection_sizes(batch.committed[r], self.blocks)
            self.refresh.record_selection(st.refresh, prefixes[i])
        self.stats.add(refreshes=len(due))

    def _queries_at(self, layer_queries: list, rows: torch.Tensor) -> torch.Tensor:
        """layer_queries[l] [num_tokens, Hq * D] of one pass, rows [n] (device) ->
        [n, num_layers, Hq, D] (fp8 queries dequantised: `dequantized_query`). A pass of
        few tokens (a middle round's) is stacked whole, then gathered once: two operations
        instead of one per layer; a larger one (vLLM's pass may hold a prefill chunk) is
        gathered layer by layer, so no copy of every layer's queries is made."""
        first = layer_queries[0]
        stack_limit = min(STACKED_QUERIES_BYTES, reads.read_limit(self.summaries))
        if (first.dtype.itemsize > 1 and first.numel() * first.element_size()
                * len(layer_queries) <= stack_limit):
            return torch.stack(layer_queries, dim=1)[rows].reshape(
                rows.shape[0], len(layer_queries), self.num_heads, self.head_size)
        qs = [q.view(q.shape[0], self.num_heads, self.head_size)[rows] for q in layer_queries]
        if qs[0].dtype.itemsize == 1:
            layers = self.vllm_config.compilation_config.static_forward_context
            qs = [dequantized_query(q, layers[name]._q_scale_float)
                  for q, name in zip(qs, self.layer_names)]
        return torch.stack(qs, dim=1)

    # ---- the passes -----------------------------------------------------------------
    def forward(self, batch, states, rows: list[int], token_ids: list[list[int]] | torch.Tensor,
                positions: list[list[int]]) -> torch.Tensor:
        """Request rows[i] runs positions[i] over its retrieval tables, with ids token_ids[i]
        (or the flat ids already on the device); returns the logits of every input token
        [sum of lengths, V]. The per-layer tables are built on the device, only as wide as
        the widest row needs; their lengths are the host's (`selection_sizes`)."""
        bs = self.blocks.block_size
        selected = stacked([states[r].selection for r in rows],
                           [states[r].selection_row for r in rows])[0]  # [n, L, max_selected]
        layout = TableLayout.of([states[r].num_selected for r in rows],
                                [states[r].tail_start for r in rows],
                                [p[-1] + 1 for p in positions], bs)
        idx, num_selected, tail_start, num_tails = to_device(
            self.device, rows, layout.num_selected, layout.tail_start, layout.num_tails)
        block_table = batch.block_table[idx]
        tables = laid_out_tables(selected, block_table, num_selected, tail_start, num_tails,
                                 layout.width)
        inputs = build_pass(token_ids, positions, block_table, bs, layout.compact_lens)
        per_layer = dict(zip(self.layer_names, tables.unbind(0)))  # one op, not one per layer
        self.capture.enabled = True  # its queries may re-select the next round's blocks
        try:
            logits = run_pass(self.model, self.vllm_config, self.attn_groups, inputs, per_layer,
                              self.stats)
        finally:
            self.capture.enabled = False
        self._pass_queries = list(self.capture.queries)
        return logits

    def full_cache_probs(self, batch, rows: list[int], token_ids: list[int],
                         positions: list[int]) -> torch.Tensor:
        """[len(rows), V]: the target over its FULL cache, request rows[i] running token_ids[i]
        at positions[i] (its first middle position: every earlier position is committed, so
        this is exactly the distribution vLLM's verification will use there). Diagnostic for
        `measure_middle_acceptance`. It writes the token's exact KV into its slot; the
        retrieval pass that follows overwrites that slot as it always does."""
        idx = batch.rows_on_device(rows)
        block_table = batch.block_table[idx]
        inputs = build_pass([[t] for t in token_ids], [[p] for p in positions], block_table,
                            self.blocks.block_size, [p + 1 for p in positions])
        per_layer = dict.fromkeys(self.layer_names, block_table)
        logits = run_pass(self.model, self.vllm_config, self.attn_groups, inputs, per_layer,
                          self.stats)
        return batch.probs(logits, rows, idx)


def fold_committed(summaries, layer_keys, committed) -> None:
    """Folded summaries: one piece of `RetrievalLevel._committed_tokens` into `summaries`."""
    rows, block_ids, offsets, runs = committed
    summaries.add_committed(layer_keys, rows, block_ids, offsets, runs)


# `_queries_at` stacks a pass's queries whole up to this size (a middle round's: 32 requests
# of a few tokens, e.g. Llama-3.1-8B 32 x 3 tokens x 32 layers x 4,096 x 2 B = 25 MiB at
# most with gamma1 = 2; at batch 8 and gamma1 = 0, 2 MiB) and one read chunk (a small
# cache's is small: engine/memory.py reserves the smaller of the two).
STACKED_QUERIES_BYTES = 32 * 2**20


def dequantized_query(query: torch.Tensor, q_scale: float) -> torch.Tensor:
    """query [n, Hq, D] as an attention impl received it -> the same in a float dtype;
    `q_scale`: the layer's `_q_scale_float`.

    With an fp8 KV cache ("fp8", "fp8_e4m3") and a backend whose impl
    `supports_quant_query_input` (FLASH_ATTN off XPU, TRITON_ATTN on CUDA, FLASHINFER with
    trtllm-gen on SM100; never CPU_ATTN), vLLM 0.32's `Attention.forward`
    (vllm/model_executor/layers/attention/attention.py, `query_quant`) quantises the query
    to fp8, clamp(query / `layer._q_scale`), before calling the impl, so the capture records
    it in fp8. The scale is per tensor (vllm/model_executor/layers/quantization/kv_cache.py
    refuses others). Scores read the query dequantised, in float32."""
    if query.dtype.itemsize >= 2:
        return query
    return query.float() * q_scale
