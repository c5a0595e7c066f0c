"""Level 2's block summaries: kept equal to the committed keys, folded or read back lazily.

By default a prompt's summaries are folded as it is computed, the rest set lazily. A
selection scores only *full* committed blocks, so a block's summaries are needed only once
it is full, and then never change. A prefill pass (a prompt chunk, or a preempted
request's recompute: more tokens than a verification) folds its keys, which the capture
holds in memory right then, into the summaries (`BlockSummaries.add_committed`, by pieces
of one read chunk); the blocks it completes are recorded as set. With `prefill_from_cache`
(config.py), a pass larger than the capture copies (vLLM's `max_cudagraph_capture_size`,
a long prompt chunk) keeps none of its keys where summaries are set lazily
(`LayerCapture.compact_large_passes`: holding every layer's keys of a 16K-token chunk
keeps 5.4 GB of activations alive at Llama-3.1-8B's shape): its prefills' full blocks are
set from the KV cache right after it, by read chunks (`set_full_blocks`), the same
summaries. Blocks completed while decoding are set just before their request selects,
from their keys read back from vLLM's KV cache (engine/paged_keys.py, `BlockReads`,
`BlockSummaries.block_values`). So a decode step in which nobody selects (every plain step)
does no per-layer TriForce work at all, and a request's first selection never reads its
whole prompt back inside a decode step (work as large as the prompt where a decode step
has the least room for it). A request that never drafts (engine/plain_steps.py
`never_drafts`) has no prompt summarised at all. Every committed token's key is folded at
every step (eagerly) where the cache cannot be read back exactly: no reader for the
backend or ISA, a reader that failed its check, an fp8 cache under float summaries (read
back, its keys are rounded; coded summaries, the default, are set from it all the same:
`_lazy_possible`), or a policy that keeps its own copy of the keys or observes every step
(topk_oracle, h2o).

Terms. *committed*: positions whose KV is exact (written by vLLM's full-cache pass and
accepted).
"""

from __future__ import annotations

import time
from itertools import compress, repeat
from operator import attrgetter, floordiv, is_not, itemgetter, ne, or_

import numpy as np
import torch
from torch._dynamo.decorators import mark_dynamic, mark_unbacked
from torch.utils._python_dispatch import _get_current_dispatch_mode
from vllm.logger import init_logger

from vllm_triforce.core import reads
from vllm_triforce.core.compiled import CompiledFunction, first_line
from vllm_triforce.core.summaries import committed_runs, token_pieces
from vllm_triforce.engine.block_contents import block_contents, common_prefix
from vllm_triforce.engine.buffers import fold_piece_tokens
from vllm_triforce.engine.device.transfer import to_device

logger = init_logger("vllm.triforce")


class SummaryKeeper:
    """Keeps `summaries` (core/summaries.BlockSummaries) of the keys `capture` records.
    The reader of vLLM's KV cache (engine/paged_keys.py) is `selector`'s key source, its
    one home: checked against the captured keys at the first commit whatever the policy
    (`status` says how that went, or why there is none: `unreadable`; `vllm-triforce
    doctor` reports it); a reader that fails its check is dropped, so a two-stage policy
    (`rerank`) keeps its first stage alone."""

    def __init__(self, summaries, capture, selector, stats, device,
                 unreadable: str | None = None):
        self.summaries = summaries
        self.capture = capture
        self.selector = selector
        self.stats = stats
        self.device = device
        self.block_size = selector.blocks.block_size
        self.status = ("not checked yet" if selector.keys is not None
                       else f"unreadable: {unreadable}" if unreadable else "no reader")
        # Summaries of blocks completed while decoding set from the KV cache just before a
        # selection (see top); decided at the first commit, by the reader's check.
        self.lazy = False
        # physical block id -> content key (engine/block_contents.py) of the complete summaries
        # held there (set from the cache, or folded from every key of a prefill): a block
        # another request summarised (a prefix-cache hit) is not set again. A block a fold
        # touches without completing is dropped from it.
        self._summarised: dict[int, int] = {}
        self.block_reads = BlockReads(summaries)  # the reads `set_full_blocks` makes

    @property
    def reader(self):
        """engine/paged_keys.PagedKeys, or None (none for this cache, or failed its check)."""
        return self.selector.keys

    # ---- the fold -------------------------------------------------------------------
    def fold(self, batch, states, prefills: list[int]) -> None:
        """The keys this pass committed into the summaries: every request's (eagerly), or
        those of the prefill passes `prefills` (see top). At the first pass with keys, the
        cache reader is checked against them first; when it reads the cache exactly and
        nothing needs eager summaries, the keeper folds prefills only from there on."""
        capture = self.capture
        if capture.keys[0] is None and not capture.compacted:
            return
        reader = self.reader
        if reader is not None and not reader.checked:  # once, at the first commit
            if capture.keys[0] is None:
                return
            first = next(self.committed_tokens(batch, self._rows_with_keys(batch)), None)
            if first is None:
                return
            self._check_reader(reader, *first[:3])
            self.lazy = self.reader is not None and self._lazy_possible()
            if self.lazy:  # no warm-up after vLLM bound its cache (enforce_eager on CPU)
                self.block_reads.compile_when_bound(self.reader, "at the first commit")
            capture.key_rows = 0  # checked: a compact pass keeps no key from now on
            if not self.lazy:  # every key folded: keep a large pass whole again
                capture.compact_rows = None
        if capture.compacted:
            self._set_prefills_from_cache(batch, states, prefills)
            return
        folded = self._lazy_folds(batch, prefills) if self.lazy else range(batch.num_reqs)
        for committed in self.committed_tokens(batch, folded):
            fold_committed(self.summaries, self.capture.keys, committed)
        if self.lazy:
            self._record_folded_blocks(batch, states, folded)

    def _rows_with_keys(self, batch) -> list[int]:
        """The requests whose committed keys the capture holds, for the reader's check:
        all, or in a compact pass those within its first `key_rows` rows (at least the
        first request, whose first fold piece, of at most `fold_tokens` = key_rows tokens
        from its first row, is held). Decided on the host from the pass's query starts."""
        if not self.capture.compacted:
            return list(range(batch.num_reqs))
        kept = self.capture.keys[0].shape[0]
        qsl = batch.query_start_loc
        return [r for r in range(batch.num_reqs) if qsl[r + 1] <= kept] or [0]

    def _set_prefills_from_cache(self, batch, states, prefills: list[int]) -> None:
        """A compact pass (`LayerCapture.compact_large_passes`) kept no keys to fold: its
        prefills' full blocks are set from vLLM's KV cache instead, now, in read chunks
        (`set_full_blocks`): the same summaries, without the pass's keys held alive. Only
        an engine whose reader failed its check on this very pass is left without them
        (logged), and keeps its large passes whole from then on."""
        if not self.lazy:
            logger.warning_once(
                "TriForce: a prefill's keys were not kept (the KV-cache reader failed its "
                "check on it); its blocks have no summaries, which lowers acceptance only.")
            return
        rows = self._lazy_folds(batch, prefills)
        if rows:
            self.set_full_blocks(batch, states, rows)

    @staticmethod
    def _lazy_folds(batch, prefills: list[int]) -> list[int]:
        """The prefill rows whose keys are folded when summaries are set lazily: those of
        requests that may draft. A request that never drafts (batch.never_drafts) needs no
        summary; should it draft after all (a fixed depth set later), its blocks are set
        lazily before it selects, as decoded blocks are (`set_full_blocks`)."""
        never = batch.never_drafts
        if never is None or not prefills:
            return prefills
        return [r for r in prefills if not never[r]]

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
        bs = self.block_size
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

    def committed_tokens(self, batch, rows):
        """Where the committed tokens of requests `rows` in this pass go, for
        `fold_committed`, in pieces of at most `fold_tokens()` tokens, a span cut only
        where a block ends (`token_pieces`): (rows of the pass,
        physical block ids, offsets, (run of each token, number of runs)) each. Which
        rows, at which positions, in which runs of one block (core/summaries.py) are all
        known on the host, so the fold never waits for the device."""
        bs, limit = self.block_size, self.fold_tokens()
        rows = np.asarray(rows, dtype=np.int64)
        starts = np.asarray(batch.verify_start, dtype=np.int64)[rows]
        counts = (np.asarray(batch.q_lens, dtype=np.int64)
                  - np.asarray(batch.num_rejected, dtype=np.int64))[rows]  # committed now
        keep = counts > 0
        rows, starts, counts = rows[keep], starts[keep], counts[keep]
        if rows.size and counts.sum() <= limit:  # one piece (every decode step)
            yield self._piece(batch, rows, starts, counts)
            return
        spans = zip(rows.tolist(), starts.tolist(), counts.tolist())
        for piece in token_pieces(spans, limit, bs):  # a piece's tokens by array operations
            owners, firsts, ns = (np.array(column, dtype=np.int64) for column in zip(*piece))
            yield self._piece(batch, owners, firsts, ns)

    def _piece(self, batch, owners: np.ndarray, starts: np.ndarray, counts: np.ndarray):
        """`committed_tokens`' piece of every span at once (`committed_runs`, by array
        operations): request owners[i] committed counts[i] tokens from position starts[i]
        (distinct owners): each token's row of the pass, physical block and offset, and its
        run of one block."""
        bs = self.block_size
        positions, owner, runs, num_runs = committed_runs(owners, starts, counts, bs)
        qsl = np.asarray(batch.query_start_loc, dtype=np.int64)
        verify_start = np.asarray(batch.verify_start, dtype=np.int64)
        pass_rows = qsl[owner] + positions - verify_start[owner]
        rows, positions, owner, runs = to_device(self.device, pass_rows, positions, owner, runs)
        block_ids = batch.block_table[owner, positions // bs].long()
        return rows, block_ids, positions % bs, (runs, num_runs)

    def fold_tokens(self) -> int:
        """Tokens folded at once (engine/buffers.py `fold_piece_tokens`; `fold_scratch_bytes`
        reserves the fold's copies)."""
        s = self.summaries
        return fold_piece_tokens(s.num_layers, s.num_kv_heads, s.head_dim,
                                 reads.read_limit(s))

    def _check_reader(self, reader, rows, block_ids, offsets) -> None:
        why = reader.check(self.capture.keys, rows, block_ids, offsets)
        self.status = f"check failed: {why}" if why else f"checked ({reader.layout})"
        if why:
            logger.warning("TriForce: keys read back from the KV cache differ from the keys "
                           "written (%s); `rerank` keeps its first stage only and block "
                           "summaries are folded eagerly. Please report this with your GPU "
                           "and attention backend.", why)
            self.selector.keys = None

    def _lazy_possible(self) -> bool:
        """Summaries set from the cache equal the eager ones (see top); over an fp8 cache
        with a reader (the GPU backends'), coded summaries (`compact_summaries`) are set from
        it too: its keys, read back within fp8's rounding of the keys written, are coded in
        one byte anyway, once, where eager folding would code a block again at every token
        it takes."""
        return ((self.reader.fp8 is None or self.summaries.coded)
                and self.summaries.keys is None and not self.selector.observes)

    def may_be_lazy(self) -> bool:
        """Whether summaries will be set from the cache once the reader passes its check
        (the capture may then keep large passes compact: `compact_large_passes`)."""
        return self.reader is not None and self._lazy_possible()

    # ---- lazily, before a selection -------------------------------------------------
    def set_full_blocks(self, batch, states, rows: list[int]) -> None:
        """Lazy summaries: set those of requests `rows`' full committed blocks that are not
        set yet. Which are is the host's to know, so nothing syncs: a request's blocks are
        first compared by physical id with the ones it last saw set (a request recomputed
        into new blocks after preemption sets them again); any other block is skipped only
        when the summaries set at its physical id were set for the same content (same
        tokens after the same prefix: a prefix-cache hit on a block another request
        summarised). Reads at most one read chunk of keys at a time (`reads.read_limit`:
        SCORE_CHUNK_BYTES, or the memory plan's smaller one).

        Most requests completed no block since they last selected: each is passed over
        without reading its blocks, and without a Python line of its own (`_changed`),
        where its list of block ids (vLLM's host copy, one KV group) is the very list it
        last read and its count of full blocks the same. Both runners only append to that
        list while the request runs and give a request resumed after preemption a new one
        (V1's `_update_states`, MRV2's records: engine/mrv2/requests.py)."""
        bs = self.block_size
        owners, logical = [], []
        committed, requests = batch.committed, batch.requests
        changed = _changed(list(map(states.__getitem__, rows)), map(requests.__getitem__, rows),
                           map(committed.__getitem__, rows), bs)
        for r in list(compress(rows, changed)):
            state = states[r]
            state.lazily_set_from = requests[r].block_ids[0]
            ids = state.lazily_set_from[:committed[r] // bs]
            full = len(ids)
            done = common_prefix(state.lazily_set_block_ids, ids)
            state.lazily_set_block_ids = ids
            if done == full:
                continue
            new_ids, contents = ids[done:], block_contents(batch, r, state, full, bs)
            if contents is None:  # always set
                to_set = range(done, full)
                self._summarised.update(dict.fromkeys(new_ids))
            else:  # except where set already, for this very content
                contents = contents[done:full]
                set_for = map(self._summarised.get, new_ids)
                to_set = list(compress(range(done, full), map(ne, set_for, contents)))
                self._summarised.update(zip(new_ids, contents))
            owners.extend(repeat(r, len(to_set)))
            logical.extend(to_set)
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
            s.write_blocks(ids, self.block_reads(self.reader, ids))
        self.stats.add(summarised_blocks=block_ids.numel())


def _changed(states: list, requests, committed, block_size: int):
    """Per request, True where its lazy summaries may be behind: its list of block ids is
    not the one it last read (`lazily_set_from`), or it has a different count of full
    blocks than it last set. By `map`: no Python line a request, where most requests of a
    step completed no block."""
    moved = map(is_not, map(_SET_FROM, states), map(_FIRST_GROUP, map(_BLOCK_IDS, requests)))
    counts = map(len, map(_SET_BLOCK_IDS, states))
    grew = map(ne, counts, map(floordiv, committed, repeat(block_size)))
    return map(or_, moved, grew)


_SET_FROM = attrgetter("lazily_set_from")
_SET_BLOCK_IDS = attrgetter("lazily_set_block_ids")
_BLOCK_IDS = attrgetter("block_ids")
_FIRST_GROUP = itemgetter(0)


def fold_committed(summaries, layer_keys, committed) -> None:
    """Folded summaries: one piece of `SummaryKeeper.committed_tokens` into `summaries`."""
    rows, block_ids, offsets, runs = committed
    summaries.add_committed(layer_keys, rows, block_ids, offsets, runs)


class BlockReads:
    """Blocks' summaries read from vLLM's KV cache, a read chunk at a time: ids [n] ->
    `BlockSummaries.block_values` of their keys, every layer's (the keeper then writes
    them: `write_blocks`). Eagerly, one read per layer into one float32 buffer (the layers'
    caches are apart), then a few operations for every layer at once: about four
    operations a layer. Or (`compiled_selection`: `wanted`) one compiled function for
    every chunk size over all the layers' caches (core/compiled.py), compiled once vLLM has
    bound its cache to the layers, which is after the engine is built (`compile_when_bound`:
    from the host's warm-up, else at the first commit, before any read). The chunk's size
    is compiled unbacked (no guard on it); where inductor refuses that (torch 2.11 on an
    H200 did: a guard on the size being 1), it is compiled again as a dynamic size, which
    holds for 2 blocks and more, and a chunk of one block is read as two (the block
    twice; its values once). A compiled call that fails is dropped with a warning, and
    the reads are eager from then on."""

    def __init__(self, summaries):
        self.summaries = summaries
        self.wanted = False  # compiled_selection
        self.compiled: CompiledFunction | None = None
        self.compile_seconds: float | None = None
        self.padded = False  # compiled for 2 blocks and more: one block is read as two
        self._tried = False

    def __call__(self, reader, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.compiled is not None:
            try:
                if self.padded and ids.numel() == 1:
                    return tuple(v[:, :1] for v in self.compiled(ids.repeat(2),
                                                                 *reader.caches()))
                return self.compiled(ids, *reader.caches())
            except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's are many kinds
                logger.warning("TriForce compiled_selection: the compiled read of block "
                               "summaries from the KV cache failed (%s: %s); they are read "
                               "eagerly from now on.", type(exc).__name__, first_line(exc))
                self.compiled = None
        s = self.summaries
        keys = torch.empty(s.num_layers, ids.numel(), s.num_kv_heads, s.block_size, s.head_dim,
                           dtype=torch.float32, device=ids.device)
        for layer in range(s.num_layers):
            keys[layer].copy_(reader.layer_keys(layer, ids))
        return s.block_values(keys)

    def compile_when_bound(self, reader, when: str) -> None:
        """Compile now if `wanted`, not tried yet, and `reader`'s caches are vLLM's bound
        cache (not the placeholders the layers hold before it exists); `when` names the
        moment in the log line. A failure is logged and leaves the reads eager."""
        if not self.wanted or self._tried or reader is None or not reader.bound():
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # vLLM's graph capture: not while a graph records
        if _get_current_dispatch_mode() is not None:
            return  # a counting mode (tools/bench) would see eager calls, not a compilation
        self._tried = True
        try:
            self.compile(reader)
        except Exception as exc:  # noqa: BLE001 - inductor's failures are many kinds
            logger.info("TriForce compiled_selection: the read of block summaries from the "
                        "KV cache does not compile for any chunk size (%s: %s); compiling it "
                        "for 2 blocks and more.", type(exc).__name__, first_line(exc))
            try:
                self.compile(reader, unbacked=False)
            except Exception as again:  # noqa: BLE001
                logger.warning("TriForce compiled_selection: compiling the read of block "
                               "summaries from the KV cache failed (%s: %s); it stays eager.",
                               type(again).__name__, first_line(again))
                return
        logger.info("TriForce compiled_selection: a read chunk of block summaries from the KV "
                    "cache, every layer's, is one compiled function (compiled %s, in %.1f s%s)",
                    when, self.compile_seconds,
                    "; a chunk of one block read as two" if self.padded else "")

    def compile(self, reader, unbacked: bool = True) -> float:
        """Compile now, over `reader`'s caches (a read of block 0 twice), the chunk's size
        unbacked, or (`unbacked` false) dynamic: the seconds it took. A compilation that
        fails raises and leaves the reads eager."""
        start = time.perf_counter()
        caches = reader.caches()
        scales = [reader.key_scale(layer) for layer in range(len(caches))]
        summaries = self.summaries

        def block_values(ids: torch.Tensor, *caches: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return summaries.block_values(reader.every_layer_keys(ids, list(caches), scales))

        self.compiled = CompiledFunction(block_values)
        ids = torch.zeros(2, dtype=torch.long, device=caches[0].device)
        if unbacked:
            mark_unbacked(ids, 0)  # the blocks of a read chunk
        else:
            mark_dynamic(ids, 0)  # from 2 blocks on; `__call__` reads one block as two
        try:
            self.compiled(ids, *caches, compile_now=True)
        except Exception:
            self.compiled = None  # eager, as before
            raise
        self.padded = not unbacked
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds
