"""Which KV blocks the middle level (the target on a retrieval cache) attends to.

`Selector` is the one owner of that decision: the engine (engine/retrieval_level.py) and
the teacher-forced acceptance benchmark (tools/bench/teacher.py) both call `Selector.choose`.
Per refresh: the policy scores the candidate blocks (`policies.py`), a two-stage policy
re-ranks its shortlist exactly (`rerank_exactly`), `select_blocks` keeps the sinks plus the
best candidates within the budget. `tables.py` turns the Selection into what vLLM's
attention metadata takes. The geometry (block size, budget, sinks, recent blocks) is one
`config.BlockCounts`.

The budget and its bounds (`num_retrieved`, `max_chosen`, `max_selected`, the smallest
budget) are `BlockCounts`'. A request whose ceil(num_committed / block_size) <=
budget_blocks, or with no more candidates than num_retrieved, selects every candidate: its
table is the full table and its attention exact. Geometry terms (sinks, tail, candidates)
are defined in `blocks.py`.

Between middle rounds (same step, same committed blocks) the engine re-selects with each
newest middle token's query, but re-ranks only a *shortlist*: each layer's best candidates
at the step's start (`Selector.choose(keep_shortlist=True)`, then `shortlist=`). A block
outside a layer's top few times num_retrieved a moment ago rarely enters its top
num_retrieved a few tokens later, while re-scoring every candidate reads every
candidate's summaries again in every round.

Chunks of requests: a selection's scratch (score tensors of every request's table, the
queries' copies) grows with the requests selecting together, so a Selector made with
`chunk_requests` (the engine's: `selection_chunk_requests` of its longest table) selects at
most that many at a time and concatenates the results, which then read as one selection.
The bound lets every request of a short-context batch select in one chunk (at 4K tokens in
blocks of 16, 128 requests), so the host does the same operations at batch 8 and 128, and
keeps a long-context batch's chunks to today's largest (32 requests of 128K tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_triforce.config import BlockCounts
from vllm_triforce.core.blocks import PAD, candidate_bounds, candidate_mask
from vllm_triforce.core.scoring import SelectionPolicy
from vllm_triforce.core.tensors import on_device

# A chunk of requests selecting together: at most this many, and at most this many blocks
# of their tables together (32 requests of 128K tokens in blocks of 16), or one request.
SELECTION_CHUNK_REQUESTS = 128
SELECTION_CHUNK_BLOCKS = 32 * 8192


def selection_chunk_requests(max_blocks: int) -> int:
    """Requests of one selection chunk, for tables of at most `max_blocks` blocks.
    Examples: 32 at 8,192 blocks (128K tokens of 16), 128 at 256 (4K), 1 past 262,144."""
    return min(SELECTION_CHUNK_REQUESTS, max(1, SELECTION_CHUNK_BLOCKS // max(max_blocks, 1)))


@dataclass
class Selection:
    """The blocks chosen for each request and layer at one refresh."""
    # [num_reqs, num_layers, max_selected] int64 logical blocks: sinks + selected,
    # ascending, padded with -1 (BlockCounts.max_selected).
    logical_blocks: Tensor
    # [num_reqs] int64, same for every layer of a request: sinks + chosen candidates
    num_selected: Tensor
    # [num_reqs] int64 logical block where the contiguous tail begins
    tail_start: Tensor


@dataclass
class Frame:
    """What a selection at one committed length fixes before any score is read, per
    request (`frame`): how many candidates it keeps, its sink blocks, its sizes; and, made
    at its first selection and kept for the next (a shortlist's, between middle rounds),
    which of k ranked candidates are kept (`kept`)."""
    num_chosen: Tensor    # [R, 1, 1] int64 candidates kept
    sink_ids: Tensor      # [R, 1, retrieval_sink_blocks] int64 sink blocks, -1 past its sinks
    num_selected: Tensor  # [R] int64 sinks + num_chosen
    tail_start: Tensor    # [R] int64
    _kept: dict = field(default_factory=dict, repr=False)  # k -> [R, 1, k] bool

    def kept(self, k: int) -> Tensor:
        """[R, 1, k] bool: rank < num_chosen, for candidates ranked best first."""
        if k not in self._kept:
            rank = torch.arange(k, device=self.num_chosen.device)
            self._kept[k] = rank < self.num_chosen
        return self._kept[k]


@dataclass
class Shortlist:
    """Each layer's best candidates at one committed length (`best_candidates`), kept to be
    re-ranked between middle rounds (`select_listed`), with what stays fixed while the
    committed blocks do, so a re-ranking computes none of it again: their physical ids,
    the selection's Frame, and (filled at the first re-ranking, `summary_rows`) the rows
    and counts the summaries are read at, and the policy's copy of those summaries
    (`SelectionPolicy.listed_copy`) until `Selector.release_copies`."""
    logical: Tensor    # [R, L, S] int64, best first, -1 padded
    physical: Tensor   # [R, L, S] int64, -1 kept
    frame: Frame
    rows: Tensor | None = None    # [R, L, S] `BlockSummaries.layer_rows` of `physical`
    counts: Tensor | None = None  # [R, L, S] float32 their token counts, >= 1
    padding: Tensor | None = None  # [R, L, S] bool logical < 0, at the first re-ranking
    copy: Tensor | None = None    # the policy's `listed_copy`, while held
    copied: bool = False          # listed_copy was asked (it may have declined: None)

    @classmethod
    def of(cls, logical: Tensor, block_table: Tensor, num_committed: Tensor,
           blocks: BlockCounts) -> "Shortlist":
        committed = on_device(num_committed, logical.device, torch.long)
        return cls(logical, _physical(block_table, logical), frame(committed, blocks))

    def part(self, rows: slice) -> "Shortlist":
        """Requests `rows` of this shortlist, with what its first re-ranking read and copied."""
        def cut(t):
            return None if t is None else t[rows]

        f = self.frame
        return Shortlist(self.logical[rows], self.physical[rows],
                         Frame(f.num_chosen[rows], f.sink_ids[rows], f.num_selected[rows],
                               f.tail_start[rows]),
                         cut(self.rows), cut(self.counts), cut(self.padding), cut(self.copy),
                         self.copied)

    def subset(self, index: Tensor) -> "Shortlist":
        """Requests `index` [n] (a device tensor) of this shortlist as a new one: its blocks
        and Frame, not what its re-ranking read or copied (the subset reads its own, and
        one copy is held at a time)."""
        f = self.frame
        return Shortlist(self.logical[index], self.physical[index],
                         Frame(f.num_chosen[index], f.sink_ids[index], f.num_selected[index],
                               f.tail_start[index]))

    def summary_rows(self, summaries) -> tuple[Tensor, Tensor]:
        """(rows, counts) of the listed blocks in `summaries`, computed once."""
        if self.rows is None:
            self.rows = summaries.layer_rows(self.physical)
            self.counts = summaries.counts[self.physical.clamp(min=0)].clamp(min=1).float()
        return self.rows, self.counts


@dataclass
class Choice:
    """What `Selector.choose` decided for a batch of requests."""
    selection: Selection
    # each layer's best candidates, kept to be re-ranked between middle rounds; None
    # unless asked for
    shortlist: Shortlist | None = None


class Selector:
    """Block selection, built once: `policy` scores, `blocks` is the geometry (its
    budget_blocks the budget), `shortlist_factor` x (retrieved blocks) candidates per layer
    are kept for the middle rounds when the policy can re-rank a shortlist (0: none),
    `keys` is where a policy with an `exact_stage` (`rerank`) reads exact keys (engine: vLLM's paged KV
    cache, engine/paged_keys.py; benchmarks: BlockSummaries' key copy; None: its first
    stage alone). The engine may drop `keys` later (a reader that failed its check).
    `chunk_requests`: the most requests that select at once (module docstring; None: all
    of a call's)."""

    def __init__(self, policy: SelectionPolicy, blocks: BlockCounts, shortlist_factor: int = 0,
                 keys=None, chunk_requests: int | None = None):
        self.policy = policy
        self.blocks = blocks
        self.keys = keys
        self.chunk_requests = chunk_requests
        # At least max_chosen, the most select_blocks ever keeps of a request's candidates,
        # so a shortlist always holds every block a selection picks and `select_listed`
        # never needs the unlisted ones.
        self.shortlist_size = (max(shortlist_factor * blocks.num_retrieved, blocks.max_chosen)
                               if policy.reranks_shortlist and shortlist_factor > 0 else 0)
        self._copies: list[Shortlist] = []  # shortlists holding a listed_copy

    def release_copies(self) -> None:
        """Free the shortlists' copies (when the engine's step is left, or before
        another shortlist's copy is made): they live in the selection's reserved scratch,
        which holds one at a time. A shortlist re-ranked again copies again."""
        for shortlist in self._copies:
            shortlist.copy, shortlist.copied = None, False
        self._copies.clear()

    @property
    def observes(self) -> bool:
        """The policy accumulates state from queries between selections (h2o)."""
        return type(self.policy).observe is not SelectionPolicy.observe

    def observe(self, query: Tensor, summaries, block_table: Tensor, num_committed: Tensor,
                states) -> None:
        self.policy.observe(query, summaries, block_table, num_committed, states)

    def choose(self, query: Tensor, summaries, block_table: Tensor, num_committed: Tensor,
               states=None, shortlist: Shortlist | None = None,
               keep_shortlist: bool = False) -> Choice:
        """query [R, L, Hq, D] (post-RoPE) of each request's newest token, block_table
        [R, max_blocks] physical ids, num_committed [R]: candidates are the committed full
        blocks. `shortlist` (a previous Choice's of this Selector, same committed blocks):
        re-rank only it, as between middle rounds (`select_listed`); else every candidate
        is scored (both stages of a two-stage policy). `keep_shortlist`: also return each
        layer's best candidates by these scores (when the policy re-ranks shortlists and
        shortlist_factor > 0). At most `chunk_requests` requests at a time, the results
        concatenated (`concat_choices`)."""
        if shortlist is not None:
            self._copy_listed(shortlist, summaries)
        num_reqs = query.shape[0]
        size = self.chunk_requests or num_reqs
        if num_reqs <= size:
            return self._choose(query, summaries, block_table, num_committed, states,
                                shortlist, keep_shortlist)
        committed = on_device(num_committed, block_table.device, torch.long)
        parts = [slice(lo, lo + size) for lo in range(0, num_reqs, size)]
        return concat_choices([
            self._choose(query[p], summaries, block_table[p], committed[p],
                         None if states is None else states[p],
                         None if shortlist is None else shortlist.part(p), keep_shortlist)
            for p in parts])

    def _copy_listed(self, shortlist: Shortlist, summaries) -> None:
        """Before a shortlist's first re-ranking: its summary rows, and the copy of what
        the next re-rankings read (one copy at a time: the scratch reserves one)."""
        shortlist.summary_rows(summaries)
        if shortlist.padding is None:
            shortlist.padding = shortlist.logical < 0
        if shortlist.copied:
            return
        self.release_copies()
        shortlist.copy = self.policy.listed_copy(summaries, shortlist.rows, shortlist.counts)
        shortlist.copied = True
        if shortlist.copy is not None:
            self._copies.append(shortlist)

    def _choose(self, query: Tensor, summaries, block_table: Tensor, num_committed: Tensor,
                states, shortlist: Shortlist | None, keep_shortlist: bool) -> Choice:
        """`choose` for one chunk of requests (a shortlist's summary rows already read)."""
        if shortlist is not None:
            chosen = self.policy.listed_selection(query, summaries, shortlist)
            if chosen is not None:
                return Choice(Selection(chosen, shortlist.frame.num_selected,
                                        shortlist.frame.tail_start))
            scores = self.policy.shortlist_scores(query, summaries, shortlist.physical,
                                                  rows=shortlist.rows, counts=shortlist.counts,
                                                  copy=shortlist.copy)
            return Choice(select_listed(scores, shortlist, self.blocks))
        if states is None and not (self.policy.exact_stage and self.keys is not None):
            chosen = self.policy.table_selection(
                query, summaries, block_table, num_committed,
                self.shortlist_size if keep_shortlist else 0)
            if chosen is not None:  # one compiled graph, query to selection and shortlist
                return chosen
        committed = on_device(num_committed, block_table.device, torch.long)
        scores = self.policy.block_scores(query, summaries, block_table, committed, states)
        scores = rerank_exactly(self.policy, scores, query, self.keys, block_table,
                                committed, self.blocks)
        kept = None
        if keep_shortlist and self.shortlist_size > 0:
            kept = Shortlist.of(best_candidates(scores, committed, self.blocks,
                                                self.shortlist_size),
                                block_table, committed, self.blocks)
        return Choice(select_blocks(scores, committed, self.blocks), kept)


def concat_choices(choices: list[Choice]) -> Choice:
    """The Choices of consecutive chunks of requests, as one (their rows in order)."""
    selection = Selection(*(torch.cat([getattr(c.selection, f) for c in choices])
                            for f in ("logical_blocks", "num_selected", "tail_start")))
    kept = [c.shortlist for c in choices]
    if kept[0] is None:
        return Choice(selection)
    frame_ = Frame(*(torch.cat([getattr(s.frame, f) for s in kept])
                     for f in ("num_chosen", "sink_ids", "num_selected", "tail_start")))
    return Choice(selection, Shortlist(torch.cat([s.logical for s in kept]),
                                       torch.cat([s.physical for s in kept]), frame_))


def select_blocks(scores: Tensor, num_committed: Tensor, blocks: BlockCounts) -> Selection:
    """scores [num_reqs, num_layers, max_blocks] (higher = keep; non-candidates ignored)."""
    num_committed = on_device(num_committed, scores.device, torch.long)
    bounds = candidate_bounds(num_committed, blocks)  # [R] each
    ranked = _rank_candidates(scores, num_committed, blocks,
                              k=min(blocks.max_chosen, scores.shape[-1]), bounds=bounds)
    return _selection_of(ranked, frame(num_committed, blocks, bounds), blocks)


def rank_table(scores: Tensor, block_table: Tensor, num_committed: Tensor,
               blocks: BlockCounts, shortlist_size: int) -> tuple[Tensor, ...]:
    """`select_blocks`, then (shortlist_size > 0) `best_candidates` and `Shortlist.of`, as
    tensors, for tables at least max(max_chosen, shortlist_size) blocks wide (a compiled
    graph's outputs, core/fused_reads.table_choice; a narrower table is padded with -1
    first: a padded block is no candidate, so nothing kept changes): the Selection's
    logical blocks, num_selected and tail_start; then the shortlist's logical and
    physical blocks [R, L, shortlist_size] and its Frame's num_chosen and sink_ids.
    num_committed [R] int64 on the device."""
    bounds = candidate_bounds(num_committed, blocks)
    kept = frame(num_committed, blocks, bounds)
    ranked = _rank_candidates(scores, num_committed, blocks, k=blocks.max_chosen, bounds=bounds)
    selection = _selection_of(ranked, kept, blocks)
    out = (selection.logical_blocks, selection.num_selected, selection.tail_start)
    if shortlist_size > 0:
        listed = ranked_candidates(scores, num_committed, blocks, shortlist_size, bounds)
        out += (listed, _physical(block_table, listed), kept.num_chosen, kept.sink_ids)
    return out


def select_listed(scores: Tensor, shortlist: Shortlist, blocks: BlockCounts) -> Selection:
    """select_blocks for a shortlist: scores [R, L, S] of its listed blocks. The same
    Selection as select_blocks over scores in which every unlisted block is -inf (the
    reference tests/core/test_core_policies.py checks it against) whenever the list holds at least as many candidates
    as a selection keeps, which a Selector's shortlist always does (`shortlist_size`);
    but it ranks S blocks instead of every block of the table, needs no candidate mask (a
    listed block is a candidate) and takes its Frame from the shortlist."""
    if shortlist.padding is None:
        shortlist.padding = shortlist.logical < 0
    ranked = rank_listed(scores, shortlist.padding, shortlist.logical,
                         min(blocks.max_chosen, scores.shape[-1]))
    return _selection_of(ranked, shortlist.frame, blocks)


def rank_listed(scores: Tensor, padding: Tensor, logical: Tensor, k: int) -> Tensor:
    """scores [R, L, S] of a shortlist's `logical` blocks [R, L, S] (`padding`: logical < 0)
    -> [R, L, k] logical blocks, best first, padding last (NaN / inf scores of listed
    blocks still rank above it)."""
    finfo = torch.finfo(torch.float32)
    scores = scores.float().nan_to_num(nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    scores = scores.masked_fill(padding, float("-inf"))
    return logical.gather(-1, scores.topk(k, dim=-1, sorted=True).indices)


_BIG = torch.iinfo(torch.long).max  # sorts after every real block, then becomes PAD


def frame(num_committed: Tensor, blocks: BlockCounts,
          bounds: tuple[Tensor, Tensor] | None = None) -> Frame:
    """The Frame of requests of num_committed [R] tokens (`bounds`: their
    `candidate_bounds`, where the caller has them)."""
    sinks, start = bounds or candidate_bounds(num_committed, blocks)
    num_chosen = _num_chosen(num_committed, blocks, start - sinks)
    sink_ids = torch.arange(blocks.retrieval_sink_blocks, device=num_committed.device)
    sink_ids = torch.where(sink_ids < sinks[:, None], sink_ids, PAD)[:, None, :]
    return Frame(num_chosen[:, None, None], sink_ids, sinks + num_chosen, start)


def _selection_of(ranked: Tensor, frame: Frame, blocks: BlockCounts) -> Selection:
    """ranked [R, L, k] logical candidates, best first (at least as many as are chosen) ->
    the Selection: the frame's sinks and the first num_chosen of `ranked`, ascending."""
    return Selection(ordered_blocks(ranked, frame.kept(ranked.shape[-1]), frame.sink_ids,
                                    blocks.max_selected),
                     frame.num_selected, frame.tail_start)


def ordered_blocks(ranked: Tensor, kept: Tensor, sink_ids: Tensor, max_selected: int) -> Tensor:
    """ranked [R, L, k] logical candidates, best first; kept [R, 1, k] bool (`Frame.kept`);
    sink_ids [R, 1, sinks] (`Frame.sink_ids`) -> [R, L, max_selected] logical blocks: the
    sinks, then the kept candidates ascending, then padding (-1)."""
    num_layers, k = ranked.shape[1], ranked.shape[-1]
    # the kept candidates ascending, then the others: the last k - num_chosen, padding
    chosen = torch.where(kept, torch.where(kept, ranked, _BIG).sort(dim=-1).values, PAD)
    room = max_selected - sink_ids.shape[-1] - k
    if room > 0:
        chosen = torch.nn.functional.pad(chosen, (0, room), value=PAD)
    # sinks come before every candidate, and a request with fewer sinks than sink blocks
    # has no candidate: no sort of the two together
    return torch.cat([sink_ids.expand(-1, num_layers, -1), chosen], dim=-1)


def best_candidates(scores: Tensor, num_committed: Tensor, blocks: BlockCounts,
                    size: int) -> Tensor:
    """[R, L, min(size, max_blocks)] int64: each layer's best candidates by `scores` (as
    select_blocks ranks them), best first, -1 past a request's last candidate."""
    committed = on_device(num_committed, scores.device, torch.long)
    return ranked_candidates(scores, committed, blocks, min(size, scores.shape[-1]),
                             candidate_bounds(committed, blocks))


def ranked_candidates(scores: Tensor, num_committed: Tensor, blocks: BlockCounts, k: int,
                      bounds: tuple[Tensor, Tensor]) -> Tensor:
    """`best_candidates` of k <= max_blocks (num_committed [R] int64 on the device, its
    `candidate_bounds` given): `rank_table`'s, compiled, where the tables' width is a size
    it cannot take the minimum with."""
    ranked = _rank_candidates(scores, num_committed, blocks, k=k, bounds=bounds)
    mask = candidate_mask(num_committed, scores.shape[-1], blocks, bounds)  # [R, B]
    is_candidate = mask.gather(1, ranked.flatten(1)).view_as(ranked)
    return ranked.masked_fill(~is_candidate, PAD)


def _physical(block_table: Tensor, listed: Tensor) -> Tensor:
    """listed [R, L, S] logical blocks (-1: padding) -> their physical ids, -1 kept."""
    logical = on_device(listed, block_table.device)
    phys = block_table.long().gather(1, logical.clamp(min=0).flatten(1)).view_as(logical)
    return phys.masked_fill(logical < 0, PAD)


def _scatter_listed(scores: Tensor, listed: Tensor, max_blocks: int) -> Tensor:
    """scores [R, L, S] of the logical blocks `listed` [R, L, S] (-1: padding) ->
    [R, L, max_blocks], -inf wherever nothing is listed (padding lands in a dropped column)."""
    num_reqs, num_layers, _ = listed.shape
    full = torch.full((num_reqs, num_layers, max_blocks + 1), float("-inf"),
                      device=scores.device)
    slot = on_device(listed, scores.device)
    slot = slot.masked_fill(slot < 0, max_blocks)
    return full.scatter_(2, slot, scores.float())[..., :max_blocks]


def rerank_exactly(policy: SelectionPolicy, scores: Tensor, query: Tensor, keys,
                   block_table: Tensor, num_committed: Tensor, blocks: BlockCounts) -> Tensor:
    """Second stage of a policy with an `exact_stage` (`key_policies.RerankPolicy`; any
    other policy's `scores`, or any with no key source `keys`, are returned as they are):
    `scores` (its first stage) shortlist each layer's best policy.factor x num_retrieved
    candidates, whose scores become their exact attention mass over the shortlist and the
    always-kept blocks (sinks, recent, tail) read from `keys` (`exact_scores`); every
    other candidate gets -inf (chosen only when the list runs out)."""
    if not policy.exact_stage or keys is None:
        return scores
    committed = on_device(num_committed, scores.device, torch.long)
    listed = best_candidates(scores, committed, blocks,
                             policy.factor * blocks.num_retrieved)  # [R, L, S] logical
    table = on_device(block_table, scores.device).long()
    bs, num_sink_blocks = blocks.block_size, blocks.retrieval_sink_blocks
    # always-kept logical blocks: [0, sinks) then [tail_start, end), -1 padded
    sinks, start = (bound[:, None] for bound in candidate_bounds(committed, blocks))
    end = (committed[:, None] + bs - 1) // bs
    slot = torch.arange(num_sink_blocks + blocks.retrieval_recent_blocks + 1,
                        device=scores.device)
    kept = torch.where(slot < sinks, slot, start + slot - sinks)
    kept = kept.masked_fill((slot >= sinks) & (kept >= end), PAD)
    kept_tokens = (committed[:, None] - kept * bs).clamp(0, bs)
    kept_phys = table.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, PAD)
    exact = policy.exact_scores(query, keys, _physical(table, listed), kept_phys, kept_tokens)
    return _scatter_listed(exact, listed, scores.shape[-1])


def _num_chosen(num_committed: Tensor, blocks: BlockCounts, num_candidates: Tensor) -> Tensor:
    """[R] candidates to keep: all of them when the request fits the budget (exact)."""
    total_blocks = (num_committed + blocks.block_size - 1) // blocks.block_size
    dense = (total_blocks <= blocks.budget_blocks) | (num_candidates <= blocks.num_retrieved)
    return torch.where(dense, num_candidates,
                       torch.full_like(num_candidates, blocks.num_retrieved))


def _rank_candidates(scores: Tensor, num_committed: Tensor, blocks: BlockCounts,
                     k: int, bounds: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """[R, L, k] logical blocks by descending score, candidates before all others
    (`bounds`: `candidate_bounds`, where the caller has them)."""
    finfo = torch.finfo(torch.float32)
    # NaN / inf scores of candidates still rank above every non-candidate (-inf).
    scores = scores.float().nan_to_num(nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    mask = candidate_mask(num_committed, scores.shape[-1], blocks, bounds)  # [R, max_blocks]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return scores.topk(k, dim=-1, sorted=True).indices
