"""Level 1: the small draft over its StreamingLLM block table (core/streaming.py).

The draft's KV lives in the same paged blocks as the target's (its layers are extra
layers of the same KV-cache group), so its StreamingLLM cache is just a compacted table:
the request's sink blocks plus its last `draft_window_blocks` blocks. Its keys are cached
after RoPE at *rebased* positions, so it never sees a position past its trained context.

Per request we track `draft_valid_upto`: the draft KV at positions [window_start, it) is
current. A round first runs the draft over the *pending* tokens (everything after that
point up to the newest token; plus the sinks the first time, or the whole window after a
rebase) and samples e_1, then single-token steps sample e_2..e_g.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from vllm_triforce.config import TriForceConfigError
from vllm_triforce.core.streaming import DraftWindow
from vllm_triforce.core.verify import GREEDY_TEMPERATURE, draw_uniforms, sample_tokens
from vllm_triforce.engine.buffers import MIDDLE_CHUNK_ROWS
from vllm_triforce.engine.device.forward import HostPass, build_pass, run_pass
from vllm_triforce.engine.device.transfer import to_device


def draft_window(shape, max_draft_position: int) -> DraftWindow:
    """The draft's window (engine/shape.EngineShape: its blocks, gamma2, gamma1); its
    StreamingLLM window plus one step's lookahead (gamma2 + gamma1) must fit the draft's
    trained context, checked before any weights load."""
    blocks, cfg = shape.blocks, shape.cfg
    try:
        return DraftWindow(num_sink_blocks=blocks.draft_sink_blocks,
                           num_window_blocks=blocks.draft_window_blocks,
                           block_size=blocks.block_size, max_draft_position=max_draft_position,
                           lookahead=shape.gamma2 + shape.gamma1)
    except ValueError as e:
        raise TriForceConfigError(
            f"speculative_config['draft_window_tokens']={cfg.draft_window_tokens} is too large "
            f"for the draft's trained context ({max_draft_position} positions): {e}. Lower "
            "draft_window_tokens or draft_sink_tokens.") from e


class DraftLevel:
    """The small draft: `model` with its attention groups `attn_groups`, over `window`."""

    def __init__(self, model, vllm_config, attn_groups, window: DraftWindow, stats,
                 generator: torch.Generator, device, round_graphs=None):
        """`round_graphs`: its passes over persistent buffers (engine/device/round_graph.py,
        with `round_graphs`); None: every pass built anew."""
        self.model = model
        self.vllm_config = vllm_config
        self.attn_groups = attn_groups
        self.window = window
        self.stats = stats
        self.generator = generator  # shared by requests without a seed of their own
        self.device = device
        self.round_graphs = round_graphs
        # a sampled step's distributions and draws as one compiled function a chunk
        # (`compiled_sampling`: core/compiled_sampling.py; set by Drafting); None: eager
        self.sampling = None

    def invalidate(self, batch, states) -> None:
        """The verification pass recomputed each request's tokens from its verify_start."""
        for r in range(batch.num_reqs):
            states[r].invalidate_draft_from(batch.verify_start[r], self.window.sink_tokens)

    def propose(self, batch, states, drafts_by_row, active, sizes, probs: bool = True):
        """sizes[i] tokens for request active[i] (`drafts_by_row[r]`: its middle tokens so
        far, engine/middle.RequestDrafts); returns the proposals [len(active),
        max(sizes)] and their probs [len(active), max(sizes), V] (zero past each request's
        size; `probs` False: None, every request greedy and its argmaxes the proposals),
        both on the device: a draft step feeds the next one without the host reading its
        tokens (the round reads them once, after verification)."""
        pending = [self._pending_tokens(batch, states[r], drafts_by_row[r], r, sizes[i])
                   for i, r in enumerate(active)]
        last = np.array([drafts_by_row[r].position for r in active], dtype=np.int64)

        def run_step(step, rows, reqs, previous):
            if step == 0:
                positions, token_ids = [pending[i][0] for i in rows], [pending[i][1] for i in rows]
            else:  # each request runs its previous proposal
                positions = [[p] for p in (last[rows] + step).tolist()]
                token_ids = previous
            return self._forward(batch, states, reqs, positions, token_ids)

        proposals, q = draft_proposals(batch, states, active, sizes, run_step, self.generator,
                                       probs=probs, sampling=self.sampling)
        for r in active:  # the pending tokens now hold current draft KV
            states[r].draft_valid_upto = drafts_by_row[r].position + 1
            states[r].draft_sinks_valid = True
        return proposals, q

    @staticmethod
    def after_round(state, drafts, num_proposed: int, num_accepted: int) -> None:
        """Proposals e_1..e_{g-1} were draft inputs; those accepted keep valid draft KV."""
        round_start = drafts.position - num_accepted - 1  # position of the round's first input
        state.draft_valid_upto = round_start + 1 + min(num_accepted, num_proposed - 1)

    def _pending_tokens(self, batch, state, drafts, row: int, size: int):
        """(positions, token ids) the draft must run before sampling e_1 for one request."""
        w = self.window
        end = drafts.position + 1  # tokens through the newest one
        start = w.window_start(end)
        if w.needs_rebase(drafts.position + size, state.draft_rebase_offset):
            start, state.draft_rebase_offset = w.rebase(end)
            state.draft_valid_upto = 0
            self.stats.add(draft_rebases=1)
        positions = []
        if not state.draft_sinks_valid:
            positions += range(0, min(w.sink_tokens, end))
        positions += range(max(state.draft_valid_upto, start, len(positions)), end)
        return positions, _token_ids(batch, drafts, row, positions)

    def _forward(self, batch, states, rows: list[int], positions: list[list[int]],
                 token_ids) -> torch.Tensor:
        """One forward of the small draft, request rows[i] running positions[i] (absolute)
        with token_ids[i] (or flat ids on the device); logits at each request's last token.
        The host describes the pass (`HostPass`: rebased positions, lengths, its
        StreamingLLM table as block-table columns); with round graphs the buffers take it
        in one copy, else its table is gathered on the device and the pass built anew."""
        host = self._host_pass(batch, states, rows, positions)
        graphs = self.round_graphs
        if graphs is not None:
            flat_ids = (token_ids if isinstance(token_ids, torch.Tensor)
                        else list(itertools.chain.from_iterable(token_ids)))
            start = time.perf_counter()
            logits = graphs.run_host(flat_ids, host, batch.block_table)
            if logits is not None:
                self.stats.add(round_graph_passes=1,
                               forward_seconds=time.perf_counter() - start)
                return logits
            self.stats.add(round_graph_misses=1)
        idx, columns = to_device(self.device, host.rows, np.maximum(host.columns, 0))
        block_table = batch.block_table[idx]
        table = block_table.gather(1, columns.view(host.columns.shape))  # past a row: unread
        inputs = build_pass(token_ids, positions, block_table, self.window.block_size,
                            host.seq_lens.tolist(), sample_last=True,
                            model_positions=np.split(host.positions,
                                                     np.cumsum(host.lens)[:-1]))
        return run_pass(self.model, self.vllm_config, self.attn_groups, inputs, table,
                        self.stats)

    def _host_pass(self, batch, states, rows: list[int],
                   positions: list[list[int]]) -> HostPass:
        """The pass of `_forward` as host arrays: its rebased positions
        (`DraftWindow.position`) and its StreamingLLM table as block-table columns
        (`DraftWindow.table_columns`)."""
        w = self.window
        lens = np.fromiter(map(len, positions), dtype=np.int64, count=len(positions))
        kv = np.fromiter(itertools.chain.from_iterable(positions), dtype=np.int64,
                         count=int(lens.sum()))
        offsets = np.array([states[r].draft_rebase_offset for r in rows], dtype=np.int64)
        rebased = np.where(kv < w.sink_tokens, kv, kv - np.repeat(offsets, lens))
        columns, seq_lens = w.table_columns(kv[np.cumsum(lens) - 1] + 1,
                                            batch.block_table.shape[1])
        return HostPass(np.asarray(rows, dtype=np.int64), lens, kv, rebased, columns,
                        seq_lens)


def _token_ids(batch, drafts, row: int, positions: list[int]) -> list[int]:
    """Ids at committed positions come from vLLM; later ones are this step's middle tokens."""
    committed_end = batch.committed[row] + 1  # next_token included
    middle = drafts.tokens if positions and positions[-1] >= committed_end else []
    out = []
    for pos in positions:
        if pos < committed_end:
            out.extend(batch.token_ids(row, pos, pos + 1))
        else:
            out.append(middle[pos - committed_end])
    return out


def draft_proposals(batch, states, active: list[int], sizes: list[int], run_step,
                    generator: torch.Generator, chunk_requests: int = MIDDLE_CHUNK_ROWS,
                    probs: bool = True, sampling=None):
    """Level 1's proposals, step by step on the device: sizes[i] tokens for request
    active[i]. Step s calls `run_step(s, rows, reqs, previous)` for the requests still
    proposing (rows: their indices in `active`, reqs: their batch rows, previous: their
    step s - 1 proposals on the device, None at step 0) and gets their logits
    [len(rows), V]; each is sampled with its request's own transform (`StepBatch.probs`,
    `sample_tokens`: its generator, else `generator`), `chunk_requests` rows at a time (the
    temporaries of a chunk, not of the batch: engine/buffers.py `vocabulary_rows`). Returns
    the proposals [len(active), max(sizes)] and their probs [len(active), max(sizes), V]
    (zero past each size), on the device: a step feeds the next without the host reading
    its tokens. `probs` False (every request greedy, nobody reads the distributions): the
    proposals are the logits' argmaxes and the probs None. `sampling`: a
    core/compiled_sampling.CompiledSampling, which turns a chunk of a step that samples
    into its distributions and tokens in one call (None: eager torch)."""
    max_size = max(sizes)
    proposals = q_all = None
    for step in range(max_size):
        rows = [i for i in range(len(active)) if sizes[i] > step]
        reqs = [active[i] for i in rows]
        all_rows = len(rows) == len(active)
        if probs:
            rows_dev, reqs_dev = to_device(batch.device, [] if all_rows else rows, reqs)
        else:  # the requests' sampling parameters are not read
            rows_dev = None if all_rows else to_device(batch.device, rows)[0]
        into = slice(None) if all_rows else rows_dev
        previous = None if step == 0 else proposals[into, step - 1]
        logits = run_step(step, rows, reqs, previous)
        if proposals is None:
            proposals = torch.zeros(len(active), max_size, dtype=torch.long,
                                    device=logits.device)
        if not probs:
            proposals[into, step] = logits.argmax(-1)
            continue
        if q_all is None:
            q_all = logits.new_zeros(len(active), max_size, logits.shape[-1],
                                     dtype=torch.float32)
        all_greedy = batch.all_greedy(reqs)
        compiled = sampling is not None and not all_greedy
        greedy = None if compiled else batch.temperature[reqs_dev] < GREEDY_TEMPERATURE
        for lo in range(0, len(rows), chunk_requests):
            c = slice(lo, lo + chunk_requests)
            generators = [states[r].generator for r in reqs[c]]
            if compiled:  # the uniforms as the eager draw takes them, then one call
                uniform = draw_uniforms(len(generators), 1, generators, logits.device,
                                        generator)[:, 0]
                q, tokens = sampling.draw(logits[c], reqs_dev[c], batch, uniform)
            else:
                q = batch.probs(logits[c], reqs[c], reqs_dev[c])  # [n, V]
                tokens = sample_tokens(q, greedy[c], generators, generator,
                                       all_greedy=all_greedy)
            chunk_into = slice(lo, lo + q.shape[0]) if all_rows else rows_dev[c]
            q_all[chunk_into, step] = q
            proposals[chunk_into, step] = tokens
    return proposals, q_all
