"""Level 2: the target over per-layer retrieval tables, one step at a time.

A step of this level runs in one order, and the code holds it: `RetrievalLevel.begin_step`
counts what vLLM accepted of last step's drafts and has the summary keeper fold the keys
that became final (engine/summary_keeper.py), and only then makes the step's
`RetrievalStep`; the step's `select` re-scores the blocks of requests due for a refresh
(core/selection.py, core/refresh.py); each middle round then runs `forward`, the target over
a different compacted block table per layer, through the stock attention backend
(zero-copy), and `select_in_middle`, which reads the queries of the step's last `forward`.
Leaving the step (`with`, or `close`) frees the shortlists' copies of the summaries its
selections made for the rounds (`Selector.release_copies`), however the step ends.

Terms. *committed*: positions whose KV is exact (written by vLLM's full-cache pass and
accepted). Selections are kept as logical blocks, by request row, in the level's
`SelectionTable` (engine/selections.py).

Slots: vLLM reserves KV slots for `num_speculative_tokens` (= gamma2) lookahead positions; a
round never drafts past gamma2 middle tokens, so every pass here writes only slots inside that
reservation. Level-2 passes write approximate target KV into the real slots of not-yet-verified
positions; vLLM's next full pass rewrites those slots before they are read, and summaries only
ever take committed keys.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from vllm_triforce.core import reads
from vllm_triforce.core.blocks import selection_sizes
from vllm_triforce.core.tables import TableLayout, laid_out_tables
from vllm_triforce.engine.batch import of_rows
from vllm_triforce.engine.buffers import STACKED_QUERIES_BYTES
from vllm_triforce.engine.depth import Verified
from vllm_triforce.engine.device.capture import LayerRows
from vllm_triforce.engine.device.forward import TIME_FORWARDS_ENV, Runs, build_pass, run_pass
from vllm_triforce.engine.device.transfer import to_device
from vllm_triforce.engine.middle import positions_of
from vllm_triforce.engine.selections import SelectionTable

# "1": a middle round's next pass, loaded ahead, is replayed before the round's copy to the
# host is waited for (`RetrievalStep.launch_ahead`); experimental, for a GPU's timing
LAUNCH_AHEAD_ENV = "VLLM_TRIFORCE_LAUNCH_AHEAD"


class RetrievalLevel:
    """The target (`model`, its attention layers `layer_names` in layer order, `attn_groups`)
    over retrieval tables that `selector` (core/selection.py: policy, geometry, shortlist,
    key source) chooses from the summaries `keeper` (engine/summary_keeper.py) keeps of the
    keys and queries `capture` records. `num_heads`, `head_size`: the target's query heads,
    to read captured queries; `pass_limits` (engine/shape.py): what one pass through
    per-layer attention builders may hold."""

    def __init__(self, model, vllm_config, attn_groups, layer_names: list[str], num_heads: int,
                 head_size: int, capture, keeper, selector, refresh, stats, device,
                 pass_limits=None, round_graphs=None, windows=None, adapters=None):
        self.model = model
        self.vllm_config = vllm_config
        self.attn_groups = attn_groups
        self.layer_names = layer_names
        self.num_heads, self.head_size = num_heads, head_size
        self.capture = capture
        self.keeper = keeper
        self.selector = selector
        self.refresh = refresh
        self.blocks = selector.blocks
        # every live request's selection, by its refresh row
        self.selections = SelectionTable(len(layer_names), self.blocks.max_selected, device)
        self._num_steps = 0
        self._last_states: list | None = None  # the last step's states, and their rows
        self._last_rows = np.zeros(0, dtype=np.int64)
        self.stats = stats
        self.device = device
        self.pass_limits = pass_limits
        # the passes over persistent buffers (engine/device/round_graph.py), with
        # `round_graphs`; None: every pass is built anew (`run_pass`)
        self.round_graphs = round_graphs
        # where a middle pass's queries go: the round buffers with `round_graphs` (also for
        # a pass that fits no bucket: vLLM's pass's buffers stay its own); None: clones
        self.middle_queries = None if round_graphs is None else round_graphs.query_buffers
        # a middle round's re-selection and the next pass's load as one graph
        # (engine/device/selection_graph.py), with `selection_graphs`: set once the
        # selection is compiled; None: `select_in_middle`, then `load_ahead`
        self.selection_graphs = None
        # the target's local layers (engine/device/forward.py `WindowLayers`),
        # which every pass runs over their own group's table; None: it has none
        self.windows = windows
        # vLLM's LoRA adapters, mapped to each pass's tokens (engine/adapters.py); None:
        # LoRA off
        self.adapters = adapters

    @property
    def summaries(self):
        """The block summaries selections read: the keeper's."""
        return self.keeper.summaries

    def begin_step(self, batch, states, judged_alone: bool) -> "RetrievalStep":
        """A new step: count what vLLM's verification accepted of last step's drafts and
        fold the keys that became final into the block summaries. `judged_alone`: the
        drafts were this level's own (no small draft), so they also count toward its
        refresh acceptance. The step's `verified`: the drafts verified of every request
        whose drafts were judged (engine/depth.Verified); its `prefills`: the rows whose
        pass was a prefill chunk (a prompt's, or a recompute's), not a decode or a
        verification."""
        # vLLM's pass ran the newest token, then at most the drafts handed to it last step
        # (the scheduler may trim them) when it verified them; more is a prefill
        num_verified = np.asarray(batch.q_lens, dtype=np.int64) - 1  # [R]
        # each request's row of the refresh policy's arrays and of the selections, by
        # batch row: the last step's again when its states are (the batch is unchanged)
        if states is not self._last_states:
            self._last_states = states
            self._last_rows = np.fromiter((st.refresh for st in states), np.int64, len(states))
        refresh_rows = self._last_rows
        handed = self.selections.take_handed(refresh_rows)  # read once: the next are new
        prefill = num_verified > handed
        rows = np.flatnonzero(~prefill & (num_verified > 0))
        num_verified = num_verified[rows]
        num_accepted = num_verified - np.asarray(batch.num_rejected, dtype=np.int64)[rows]
        verified = Verified(of_rows(batch.req_ids, rows), num_verified, num_accepted)
        prefills = np.flatnonzero(prefill).tolist()
        if rows.size:
            if judged_alone:
                self.refresh.record_rounds(refresh_rows[rows], num_verified, num_accepted)
            self.stats.record_verification(int(num_verified.sum()), int(num_accepted.sum()))
        self.keeper.fold(batch, states, prefills)
        self._num_steps += 1
        return RetrievalStep(self, batch, states, verified, prefills, refresh_rows,
                             number=self._num_steps)


class RetrievalStep:
    """One step of the retrieval level over `batch` and its request `states` (made by
    `RetrievalLevel.begin_step`, after the commit, with what the commit found: `verified`,
    `prefills`). Its own state: the rows whose blocks are summarised this step (committed
    lengths and blocks change only between steps), the seconds that took, the queries of
    its last `forward`, the shortlist its start kept (`SelectionTable.keep_shortlist`
    under the step's `number`) and the last one of a subset of rows it re-ranked."""

    def __init__(self, level: RetrievalLevel, batch, states, verified, prefills,
                 refresh_rows: np.ndarray, number: int = 0):
        self.level = level
        self.batch, self.states = batch, states
        # [R] each request's row of the refresh policy, and of the level's selections
        self.refresh_rows = refresh_rows
        self.number = number
        self.verified: Verified = verified
        self.prefills: list[int] = prefills
        # this step's time setting lazy summaries: the blocks a request completed since it
        # last selected (after a plain stretch, all of that stretch's at once), so the
        # depth controller does not count it as a cost of drafting (`DepthStep.end`)
        self.summarise_seconds = 0.0
        self._summarised_rows = np.zeros(batch.num_reqs, dtype=bool)  # [R]
        self._pass_queries: list | None = None  # per layer, the last `forward`'s queries
        self._shortlist = None  # core/selection.Shortlist the step start kept
        # (its rows, the Shortlist of those rows): the last subset `_listed` made
        self._last_subset: tuple | None = None
        # re-selections so far this step, and the last `_selections_of` (key, value)
        self._num_reselects = 0
        self._rows_selections: tuple | None = None
        # (rows, positions, RoundGraphs' LoadedPass[, its logits]): the next round's pass,
        # loaded ahead (and, with LAUNCH_AHEAD_ENV, replayed ahead)
        self._ahead: tuple | None = None
        # what this step put into the selection graphs' buffers: the Shortlist, and the
        # rows whose block tables (`_hold_tables`)
        self._graph_listed = None
        self._graph_rows: bytes | None = None

    def __enter__(self) -> "RetrievalStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """The step is over: free the shortlists' copies of the summaries (the shortlists
        themselves stay with their requests until the next selection)."""
        self.level.selector.release_copies()
        self._pass_queries = None

    def record_handed(self, rows: np.ndarray, num_drafts: list[int]) -> None:
        """Decoding rows `rows` were handed num_drafts[i] drafts (what the next step's
        `begin_step` counts as verified)."""
        self.level.selections.record_handed(self.refresh_rows[rows],
                                            np.asarray(num_drafts, dtype=np.int64))

    def _summarise(self, rows: np.ndarray) -> None:
        """Lazy summaries of requests `rows`' full committed blocks (the keeper's
        `set_full_blocks`), each row at most once a step."""
        keeper = self.level.keeper
        if not keeper.lazy:
            return
        rows = rows[~self._summarised_rows[rows]]
        if not rows.size:
            return
        self._summarised_rows[rows] = True
        start = time.perf_counter()
        try:
            keeper.set_full_blocks(self.batch, self.states, rows.tolist())
        finally:
            self.summarise_seconds += time.perf_counter() - start

    # ---- select ---------------------------------------------------------------------
    def select(self, rows: list[int], middle_tokens=None) -> None:
        """Re-select the blocks of requests `rows` due a refresh, with the query of their
        newest committed token (vLLM's pass); the others' policies observe.
        `middle_tokens` [n] (None: not known): the middle tokens each will draft this
        step. A request whose selection is still current (it was made between the last
        step's rounds, at the token vLLM's pass ended on) but which will re-select between
        this step's rounds anyway (at its first, with refresh_interval 1) re-selects now
        instead, and keeps this step's shortlist: without one, each of its re-selections
        between rounds would score every candidate, and a round holding it could not
        re-rank as one graph (`selection_graphs`)."""
        level, batch, states = self.level, self.batch, self.states
        # a request that never selected is due (its policy row has no selection yet)
        rows = np.asarray(rows, dtype=np.int64)
        committed = batch.committed_array[rows]
        refresh_due = level.refresh.due_at_start(self.refresh_rows[rows], committed)
        if middle_tokens is not None and level.selector.shortlist_size > 0:
            # its first re-selection between rounds: the query of its first middle token
            refresh_due |= ((np.asarray(middle_tokens) >= 2)
                            & level.refresh.due_in_middle(self.refresh_rows[rows],
                                                          committed + 1))
        queries = level.capture.queries
        if queries[0] is None:
            return
        due, rest = rows[refresh_due], rows[~refresh_due]
        self._summarise(due)
        if rest.size and level.selector.observes:  # h2o accumulates (eager summaries)
            idx, query_rows, committed = to_device(
                level.device, rest, self._newest_rows(rest), batch.committed_array[rest])
            level.selector.observe(self._queries_at(queries, query_rows), level.summaries,
                                   batch.block_table[idx], committed,
                                   [states[r].policy_state for r in rest.tolist()])
        if due.size:
            self._reselect(due.tolist(), queries, self._newest_rows(due),
                           batch.committed_array[due], keep_shortlist=True)

    def _newest_rows(self, rows: np.ndarray) -> np.ndarray:
        """Where the capture keeps the query of requests `rows`' newest committed token of
        vLLM's pass (its row of the pass, or of a compact pass's kept rows:
        `LayerCapture.last_rows`)."""
        batch = self.batch
        return self.level.capture.last_rows(rows, batch.last_committed_rows[rows],
                                            batch.query_start_loc)

    def select_in_middle(self, rows, drafts) -> None:
        """Between middle rounds: requests `rows` (a list or array) due a refresh re-select
        with the query of their newest middle token (its `query_row` in `drafts`, the
        step's middle tokens (engine/middle.MiddleDrafts, or a mapping row ->
        RequestDrafts), in the pass `forward` just ran, at its `position` - 1): the queries
        `forward` kept of its pass (the capture's buffers: called before another target
        pass can reuse them).
        Requests holding this step's shortlist re-rank only it; any other scores every
        candidate. With no refresh interval none is ever due (`due_in_middle`)."""
        refresh = self.level.refresh
        if self._pass_queries is None or refresh.interval <= 0:
            return
        rows = np.asarray(rows, dtype=np.int64)
        positions, query_rows = positions_of(drafts, rows)
        due = refresh.due_in_middle(self.refresh_rows[rows], positions)
        if not due.any():
            return
        due_rows, query_rows, positions = rows[due], query_rows[due], positions[due]
        self._summarise(due_rows)
        # requests holding this step's shortlist (the step start selected them) re-rank it
        holds = (self.level.selections.shortlist_step[self.refresh_rows[due_rows]]
                 == self.number)
        for group, use_list in ((holds, True), (~holds, False)):
            if group.any():
                self._reselect(due_rows[group].tolist(), self._pass_queries,
                               query_rows[group], positions[group], use_shortlist=use_list)

    def reselect_and_load(self, rows: np.ndarray, drafts, tokens: torch.Tensor, picked,
                          positions: Runs) -> bool:
        """`select_in_middle(rows, drafts)`, then `load_ahead(rows, tokens, picked,
        positions)`, as one run of the level's selection graphs (engine/device/
        selection_graph.py): True. Where they cannot (none; some request not due or not
        holding this step's shortlist; fp8 queries; more than one token a request; the
        compiled re-ranking dropped; no bucket fits), False, and nothing is selected or
        loaded: the caller makes the two calls."""
        level = self.level
        graphs, queries = level.selection_graphs, self._pass_queries
        if (graphs is None or level.round_graphs is not graphs.graphs
                or not isinstance(queries, LayerRows) or level.refresh.interval <= 0
                or queries.buffer.dtype.itemsize == 1 or (positions.lens != 1).any()
                or level.selector.policy.compiled is not graphs.compiled):
            return False
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size > graphs.bounds.max_requests:  # no bucket holds them
            return False
        prefixes, query_rows = positions_of(drafts, rows)
        slots = self.refresh_rows[rows]
        if (not level.refresh.due_in_middle(slots, prefixes).all()
                or not (level.selections.shortlist_step[slots] == self.number).all()):
            return False
        self._summarise(rows)
        if not self._hold_tables(graphs, rows):
            return False
        listed = self._listed(slots)
        if listed is not self._graph_listed:
            graphs.set_listed(listed, level.summaries)
            self._graph_listed = listed
        num_selected, tail_start = selection_sizes(self.batch.committed_array[rows],
                                                   level.blocks)
        done = graphs.load(tokens, picked, query_rows, slots, positions.starts, num_selected,
                           tail_start, queries.buffer)
        if done is None:
            return False
        loaded, selected, slots_dev = done
        level.selections.record(slots, slots_dev, selected, num_selected, tail_start)
        level.refresh.record_selections(slots, prefixes)
        self._num_reselects += 1
        level.stats.add(refreshes=len(rows), round_graph_selections=1)
        self._ahead = (rows.tolist(), positions, loaded)
        return True

    def _reselect(self, due: list[int], layer_queries: list, query_rows, prefixes,
                  keep_shortlist: bool = False, use_shortlist: bool = False) -> None:
        """Request due[i] re-selects with the query at row query_rows[i] of the pass whose
        per-layer queries are `layer_queries`: its token at position prefixes[i] - 1.
        Candidates are the committed full blocks either way. `keep_shortlist`: keep each
        layer's best candidates for this step's middle rounds; `use_shortlist`: score only
        those (every request in `due` holds this step's). The selection stays on the
        device; its sizes, which the host needs, follow from the committed length alone
        (core/blocks.selection_sizes)."""
        level, batch, states = self.level, self.batch, self.states
        committed, slots = batch.committed_array[due], self.refresh_rows[due]
        idx, query_rows, committed_dev, slots_dev = to_device(level.device, due, query_rows,
                                                              committed, slots)
        listed = self._listed(slots) if use_shortlist else None
        choice = level.selector.choose(
            self._queries_at(layer_queries, query_rows), level.summaries, batch.block_table[idx],
            committed_dev, [states[r].policy_state for r in due] if level.selector.observes
            else None, shortlist=listed, keep_shortlist=keep_shortlist)
        # written into the requests' rows at once: no operation per request
        level.selections.record(slots, slots_dev, choice.selection.logical_blocks,
                                *selection_sizes(committed, level.blocks))
        if choice.shortlist is not None:
            self._shortlist = choice.shortlist
            level.selections.keep_shortlist(slots, self.number)
        level.refresh.record_selections(slots, prefixes)
        self._num_reselects += 1
        level.stats.add(refreshes=len(due))

    def _listed(self, slots: np.ndarray):
        """The rows of this step's shortlist that the requests at refresh rows `slots`
        hold, as one Shortlist: the shortlist itself when they are all of it, in order,
        else its `subset`. Requests only drop out of the middle rounds, so a subset
        repeats: the one made last for the same rows is taken again, with the summary rows
        and copy it holds."""
        shortlist = self._shortlist
        listed_rows = self.level.selections.shortlist_row[slots].tolist()
        if listed_rows == list(range(shortlist.logical.shape[0])):
            return shortlist
        last = self._last_subset
        if last is None or last[0] != listed_rows:
            index = to_device(self.level.device, listed_rows)[0]
            self._last_subset = (listed_rows, shortlist.subset(index))
        return self._last_subset[1]

    def _queries_at(self, layer_queries: list, rows: torch.Tensor) -> torch.Tensor:
        """layer_queries[l] [num_tokens, Hq * D] of one pass, rows [n] (device) ->
        [n, num_layers, Hq, D] (fp8 queries dequantised: `dequantized_query`). A round
        buffer's `LayerRows` is gathered in one operation. A pass of
        few tokens (a middle round's) is stacked whole, then gathered once: two operations
        instead of one per layer; a larger one (vLLM's pass may hold a prefill chunk) is
        gathered layer by layer, so no copy of every layer's queries is made."""
        level, first = self.level, layer_queries[0]
        if isinstance(layer_queries, LayerRows) and first.dtype.itemsize > 1:
            return layer_queries.at(rows).reshape(rows.shape[0], len(layer_queries),
                                                  level.num_heads, level.head_size)
        stack_limit = min(STACKED_QUERIES_BYTES, reads.read_limit(level.summaries))
        if (first.dtype.itemsize > 1 and first.numel() * first.element_size()
                * len(layer_queries) <= stack_limit):
            return torch.stack(layer_queries, dim=1)[rows].reshape(
                rows.shape[0], len(layer_queries), level.num_heads, level.head_size)
        qs = [q.view(q.shape[0], level.num_heads, level.head_size)[rows] for q in layer_queries]
        if qs[0].dtype.itemsize == 1:
            layers = level.vllm_config.compilation_config.static_forward_context
            qs = [dequantized_query(q, layers[name]._q_scale_float)
                  for q, name in zip(qs, level.layer_names)]
        return torch.stack(qs, dim=1)

    # ---- the passes -----------------------------------------------------------------
    def forward(self, rows: list[int], token_ids: list[int] | torch.Tensor,
                positions: Runs) -> torch.Tensor:
        """Request rows[i] runs positions.lens[i] tokens from positions.starts[i] over its
        retrieval tables, with the flat ids `token_ids` (host, or already on the device);
        returns the logits of every input token [sum of lengths, V]. The per-layer tables
        are built on the device, only as wide as the widest row needs; their lengths are
        the host's (`selection_sizes`). Keeps the pass's queries for `select_in_middle`."""
        level, batch = self.level, self.batch
        bs = level.blocks.block_size
        # its queries may re-select the next round's blocks: the capture records them
        loaded, logits = self._take_loaded(rows, positions)
        if loaded is None and level.round_graphs is not None:
            loaded = self._loaded(rows, token_ids, positions)
        if logits is None and loaded is not None:
            logits = self._replayed(loaded)
        if logits is None:
            selected, sizes, block_table = self._selections_of(rows)
            layout = TableLayout.of(*sizes, positions.starts + positions.lens, bs)
            num_selected, tail_start, num_tails = to_device(
                level.device, layout.num_selected, layout.tail_start, layout.num_tails)
            tables = laid_out_tables(selected, block_table, num_selected, tail_start,
                                     num_tails, layout.width)
            inputs = build_pass(token_ids, positions, block_table, bs, layout.compact_lens,
                                model_positions=self._rotated(rows, positions))
            per_layer = dict(zip(level.layer_names, tables.unbind(0)))  # one op, not per layer
            windows = self._window_passes(rows, inputs, block_table,
                                          positions.starts + positions.lens)
            with level.capture.recording(into=level.middle_queries):
                logits = run_pass(level.model, level.vllm_config, level.attn_groups, inputs,
                                  per_layer, level.stats, level.pass_limits, windows,
                                  self._adapters_for(rows))
        queries = level.capture.queries  # a list, or a replay's LayerRows (not rewritten)
        self._pass_queries = queries if isinstance(queries, LayerRows) else list(queries)
        return logits

    def _adapters_for(self, rows):
        """What maps each chunk of a pass of requests `rows` to their LoRA adapters before
        it runs (`run_pass`'s `before`); None with LoRA off."""
        adapters = self.level.adapters
        if adapters is None:
            return None
        rows = np.asarray(rows, dtype=np.int64)

        def before(chunk, requests: range) -> None:
            adapters.set_for(rows[requests.start:requests.stop], chunk.query_start_loc,
                             chunk.sample_rows)
        return before

    def _window_passes(self, rows, inputs, block_table: torch.Tensor, true_lens) -> list:
        """The passes of the target's local layers beside TriForce's pass `inputs`
        of requests `rows` (`block_table`: their rows of TriForce's group's table), at
        `true_lens` (engine/device/forward.py `WindowLayers.passes`); [] without any."""
        windows = self.level.windows
        if windows is None:
            return []
        return windows.passes(inputs, self._window_tables(rows, block_table), true_lens)

    def _window_tables(self, rows, block_table: torch.Tensor) -> dict:
        """gid -> requests `rows`' rows of each local group's block table (`block_table`,
        theirs of TriForce's group, where the local layers share it: vLLM's hybrid
        KV-cache manager off)."""
        own = self.batch.window_tables or {}
        idx = None if not own else self.batch.rows_on_device(rows)
        return {gid: block_table if gid not in own else own[gid][idx]
                for gid in self.level.windows.names}

    def _rotated(self, rows, positions: Runs) -> Runs | None:
        """The positions requests `rows` rotate with where the target uses M-RoPE and one
        of them holds images or videos: each shifted by its request's delta
        (`StepBatch.rope_shift`), as vLLM's runner places a generated token; None (the KV
        positions) everywhere else."""
        shift = self.batch.rope_shift
        if shift is None:
            return None
        return Runs(positions.starts + shift[rows], positions.lens)

    def load_ahead(self, rows, tokens: torch.Tensor, picked, positions: Runs) -> None:
        """Load the next round's pass into the round buffers now, before this round's copy
        to the host (engine/middle.py `MiddleLoop._ahead`): request rows[i] running
        positions.lens[i] tokens from positions.starts[i], with the flat ids `tokens`
        (this round's, still on the device), or with `picked` [n] (host) those at these
        indices of them. Called after the next round's re-selection; `forward` replays it
        when asked for exactly these rows and positions (any other pass loads anew).
        Nothing without round graphs, or where the pass fits no bucket."""
        if self.level.round_graphs is None:
            return
        if picked is not None:
            tokens = tokens[to_device(tokens.device, picked)[0]]
        loaded = self._loaded(rows, tokens, positions, count_miss=False)  # `forward` will
        self._ahead = None if loaded is None else (list(rows), positions, loaded)

    def launch_ahead(self) -> None:
        """Replay the pass `load_ahead` (or `reselect_and_load`) loaded now, where
        LAUNCH_AHEAD_ENV is "1": called by the middle loop once it has asked for this
        round's copy to the host and before it waits for it (engine/middle.py `_on_host`),
        so on a GPU the next round's pass runs on the device while the host takes this
        round's tokens and does its bookkeeping; `forward` returns its logits when asked
        for the same rows and positions. Its replay reads only what the stream has written
        before it (the loaded buffers; the graph's logits and captured queries it
        overwrites were read by this round's argmax and re-selection, queued before it).
        Off by default until a GPU has run it exact."""
        if (self._ahead is None or len(self._ahead) > 3
                or os.environ.get(LAUNCH_AHEAD_ENV) != "1"):
            return
        self._ahead = (*self._ahead, self._replayed(self._ahead[2]))
        self.level.stats.add(round_graph_launched_ahead=1)

    def _take_loaded(self, rows, positions: Runs):
        """(the pass `load_ahead` loaded, its logits if `launch_ahead` replayed it, else
        None), if it is this one, else (None, None); forgotten either way."""
        ahead, self._ahead = self._ahead, None
        if (ahead is None or ahead[0] != list(rows)
                or not np.array_equal(ahead[1].starts, positions.starts)
                or not np.array_equal(ahead[1].lens, positions.lens)):
            return None, None
        self.level.stats.add(round_graph_ahead=1)
        return ahead[2], (ahead[3] if len(ahead) > 3 else None)

    def _loaded(self, rows, token_ids, positions: Runs, count_miss: bool = True):
        """Requests `rows`' pass loaded into the round buffers (`RoundGraphs.load_runs`,
        from the host's values, its tables laid out into the buffer; with selection
        graphs, a pass of one host token a request as one graph: `_layout_graph`); None,
        counted as a miss: it fits no bucket, and takes `run_pass`."""
        level = self.level
        selected, sizes, block_table = self._selections_of(rows)
        loaded = self._layout_graph(rows, token_ids, positions, selected, sizes, block_table)
        if loaded is not None:
            return loaded
        layout = TableLayout.of(*sizes, positions.starts + positions.lens,
                                level.blocks.block_size)
        window_tables = None
        if level.round_graphs.windows:
            window_tables = self._window_tables(rows, block_table)
        loaded = level.round_graphs.load_runs(token_ids, positions, block_table, layout,
                                              selected, window_tables)
        if loaded is None and count_miss:
            level.stats.add(round_graph_misses=1)
        return loaded

    def _layout_graph(self, rows, token_ids, positions: Runs, selected, sizes, block_table):
        """`RoundGraphs.load_runs` of a pass of one token a request, its ids on the host
        (a step's first middle pass), as one run of the selection graphs without their
        re-ranking (`SelectionGraphs.load_selected`); None where there are none, or they
        cannot (then nothing is loaded)."""
        graphs = self.level.selection_graphs
        if (graphs is None or graphs.graphs is not self.level.round_graphs
                or isinstance(token_ids, torch.Tensor) or (positions.lens != 1).any()
                or len(rows) > graphs.bounds.max_requests
                or not self._hold_tables(graphs, rows, block_table)):
            return None
        loaded = graphs.load_selected(token_ids, positions.starts, *sizes, selected)
        if loaded is not None:
            self.level.stats.add(round_graph_layouts=1)
        return loaded

    def _hold_tables(self, graphs, rows, block_table: torch.Tensor | None = None) -> bool:
        """Whether the selection graphs hold requests `rows`' block tables, copied in unless
        they hold them already (`block_table`: those tables [n, width]; None: gathered from
        the batch); False, nothing written, where the tables are wider than the graphs'
        `max_blocks`."""
        key = np.asarray(rows, dtype=np.int64).tobytes()
        if self._graph_rows == key:
            return True
        if block_table is None:
            block_table = self.batch.block_table[to_device(self.level.device, rows)[0]]
        if block_table.shape[1] > graphs.max_blocks:
            return False
        graphs.set_block_tables(block_table)
        self._graph_rows = key  # their tables are the graphs' now
        return True

    def _replayed(self, loaded) -> torch.Tensor:
        """The loaded pass replayed over the level's persistent buffers."""
        level = self.level
        start = time.perf_counter()
        logits = level.round_graphs.replay(loaded)
        if logits.is_cuda and os.environ.get(TIME_FORWARDS_ENV) == "1":
            torch.cuda.synchronize(logits.device)
        level.stats.add(round_graph_passes=1, forward_seconds=time.perf_counter() - start)
        level.stats.max_pass_tokens = max(level.stats.max_pass_tokens, loaded.num_tokens)
        return logits

    def _selections_of(self, rows: list[int]):
        """(selected [n, L, max_selected] logical blocks on the device, (num_selected [n],
        tail_start [n]) on the host, block_table [n, width]) of requests `rows`: gathered
        once, and taken again by every pass over the same rows until one of them
        re-selects (a step's middle rounds run the same rows while none drops out)."""
        key = (self._num_reselects, rows)
        if self._rows_selections is not None and self._rows_selections[0] == key:
            return self._rows_selections[1]
        table, slots = self.level.selections, self.refresh_rows[rows]
        idx, slots_dev = to_device(self.level.device, rows, slots)
        selected, sizes = table.of(slots_dev), table.sizes(slots)
        block_table = self.batch.block_table[idx]
        self._rows_selections = (key, (selected, sizes, block_table))
        return selected, sizes, block_table

    def full_cache_probs(self, rows: list[int], token_ids: list[int],
                         positions: list[int]) -> torch.Tensor:
        """[len(rows), V]: the target over its FULL cache, request rows[i] running token_ids[i]
        at positions[i] (its first middle position: every earlier position is committed, so
        this is exactly the distribution vLLM's verification will use there). Diagnostic for
        `measure_middle_acceptance`. It writes the token's exact KV into its slot; the
        retrieval pass that follows overwrites that slot as it always does."""
        level, batch = self.level, self.batch
        idx = batch.rows_on_device(rows)
        block_table = batch.block_table[idx]
        inputs = build_pass([[t] for t in token_ids], [[p] for p in positions], block_table,
                            level.blocks.block_size, [p + 1 for p in positions],
                            model_positions=self._rotated(rows, Runs(
                                np.asarray(positions), np.ones(len(rows), dtype=np.int64))))
        per_layer = dict.fromkeys(level.layer_names, block_table)
        logits = run_pass(level.model, level.vllm_config, level.attn_groups, inputs,
                          per_layer, level.stats, level.pass_limits,
                          self._window_passes(rows, inputs, block_table,
                                              [p + 1 for p in positions]),
                          self._adapters_for(rows))
        return batch.probs(logits, rows, idx)


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
