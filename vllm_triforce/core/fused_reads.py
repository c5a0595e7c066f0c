"""Block scores read from coded summaries in one compiled kernel (`compiled_scoring`,
config.py).

The retrieval policy scores blocks at each step's selection (every block of a request's
table) and between middle rounds (each layer's shortlist): for every block, q . mean key
(+ 1/2 q^2 . key variance) over its KV heads' channels, from summaries coded in one byte a
value (core/summary_coding.py). Both are rows of the stores viewed as [L * N, H, D]
(`BlockSummaries.layer_rows`), [R, L, S] of them. Read in eager torch, the
codes are gathered and decoded to float32 in chunks of at most one read chunk
(core/reads.py) and multiplied chunk by chunk: at Llama-3.1-8B's shape (8 requests,
32 layers, 988 listed blocks, 8 x 128 channels) 1 GiB of float32 a store in 16 chunks,
some 25 host operations a chunk, every round of a shortlist's re-ranking. Compiled (torch.compile, inductor), the
gather, the decode (a 256-entry table, `summary_coding.decode_table`), the products and
the sums over channels are one kernel that allocates nothing larger than its result
[R, L, S]: a launch or two a round, whatever the shape.

The requests and listed-blocks axes are marked unbacked (dynamo's `mark_unbacked`), so
one compilation serves every batch, table and shortlist size, 1 included: a size never
seen compiles nothing. The first call compiles (about 10 s on a CPU); the engine makes it
at start-up (`CompiledScores.warm_up`), and a compilation that fails there leaves the
scores to the eager reads, with a warning.

Example (tests/core/test_core_fused_reads.py): a store of 4 rows, one layer, one KV head,
two channels, coded "fp8" from [1, -2], [0.5, 0.5], [4, 0], [0, 3]; rows [[0, 1, 3]] with
weights [1, 1] and counts [1, 2, 1] score [-1, 0.5, 3] (row 1: (0.5 + 0.5) / 2).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from torch._dynamo.decorators import mark_unbacked
from torch.utils._python_dispatch import _get_current_dispatch_mode

from vllm_triforce.core.summary_coding import CodedStore, decode_table


def listed_dots(rows: Tensor, counts: Tensor, weights: Tensor, codes: Tensor,
                scales: Tensor, table: Tensor, more_weights: Tensor | None = None,
                more_codes: Tensor | None = None, more_scales: Tensor | None = None,
                more_table: Tensor | None = None) -> Tensor:
    """rows [R, L, S] of the stores viewed as [L * N, H, D]; counts [R, L, S] float32;
    weights [R, L, H, D] float32 for the store `codes` [L * N, H, D] uint8 with `scales`
    [L * N, H, 1] and decode `table` [256]; optionally a second store (the key variance)
    and its weights -> [R, L, S] float32: sum over H and D of weights x decoded rows, over
    counts. Eager, it holds the decoded rows ([R, L, S, H, D] float32): for tests and small
    shapes; compiled (`CompiledScores`), one kernel."""
    decoded = table[codes[rows].long()] * scales[rows]  # [R, L, S, H, D]
    dots = (decoded * weights[:, :, None]).sum((-1, -2))
    if more_codes is not None:
        decoded = more_table[more_codes[rows].long()] * more_scales[rows]
        dots = dots + (decoded * more_weights[:, :, None]).sum((-1, -2))
    return dots / counts


def table_dots(ids: Tensor, counts: Tensor, num_blocks: int, weights: Tensor, *stores):
    """`listed_dots` of every layer's rows of the blocks ids [R, B] (physical, >= 0), with
    their counts [R, B] float32: a step's selection's scores [R, L, B]. The rows are
    worked out inside (layer l's block b: row l * num_blocks + b), so that, compiled, the
    kernel holds nothing of size [R, L, B] but the scores."""
    layers = torch.arange(weights.shape[1], device=ids.device)[None, :, None]
    return listed_dots(layers * num_blocks + ids[:, None, :], counts[:, None, :], weights,
                       *stores)


class CompiledScores:
    """`listed_dots` and `table_dots` compiled over one summaries' coded stores (`sums`,
    and with the key variance `deviations()`), built once per engine: `listed` scores
    a shortlist's rows, `tables` a step's tables."""

    def __init__(self, summaries, variance: bool):
        self.summaries = summaries
        stores = [summaries.sums, *([summaries.deviations()] if variance else [])]
        if not all(isinstance(s, CodedStore) for s in stores):
            raise ValueError("CompiledScores reads coded summaries (compact_summaries)")
        self._stores = [(flat(s.codes), flat(s.scales), decode_table(s.coding, s.device))
                        for s in stores]
        self._listed = torch.compile(listed_dots, dynamic=True, fullgraph=True)
        self._tables = torch.compile(table_dots, dynamic=True, fullgraph=True)
        self.compile_seconds: float | None = None  # set by warm_up

    def listed(self, rows: Tensor, counts: Tensor, weights: list[Tensor],
               compile_now: bool = False) -> Tensor:
        """rows, counts [R, L, S] (`Shortlist.summary_rows`); weights: one [R, L, H, D]
        float32 per store -> scores [R, L, S]."""
        return self._run(self._listed, listed_dots, [rows, counts], (), weights, compile_now)

    def tables(self, ids: Tensor, counts: Tensor, weights: list[Tensor],
               compile_now: bool = False) -> Tensor:
        """ids, counts [R, B] (physical blocks >= 0, their token counts); weights: one
        [R, L, H, D] float32 per store -> scores [R, L, B]."""
        return self._run(self._tables, table_dots, [ids, counts],
                         (self.summaries.num_blocks,), weights, compile_now)

    def _run(self, compiled, eager, index: list[Tensor], fixed: tuple,
             weights: list[Tensor], compile_now: bool) -> Tensor:
        """After `warm_up` nothing compiles again: a call that would (a guard no size
        should fail) raises (dynamo's stance "fail_on_recompile") rather than run the eager
        arithmetic, which would hold the decoded rows; the policy then reads eagerly, in
        chunks."""
        with torch.inference_mode():  # the engine's tensors: what the kernels were made for
            index = [_inference(index[0]), _inference(index[1].float())]
            weights = [_inference(w.float().contiguous()) for w in weights]
        for t in (*index, *weights):
            mark_unbacked(t, 0)  # requests
        for t in index:
            mark_unbacked(t, t.dim() - 1)  # listed blocks, or the tables' width
        (codes, scales, table), *more = self._stores
        args = (*index, *fixed, weights[0], codes, scales, table,
                *(() if not more else (weights[1], *more[0])))
        if _get_current_dispatch_mode() is not None:
            # a dispatch mode (tools/bench: syncs.py's counter) is watching: dynamo compiles
            # nothing under one, so the same arithmetic runs eagerly, where it sees it
            return eager(*args)
        stance = "default" if compile_now else "fail_on_recompile"
        # one grad mode for every call: no recompilation
        with torch.inference_mode(), torch.compiler.set_stance(stance):
            return compiled(*args)

    def warm_up(self) -> float:
        """Compile both now (2 requests, 3 blocks, block 0): the seconds it took."""
        s = self.summaries
        start = time.perf_counter()
        weights = [torch.zeros(2, s.num_layers, s.num_kv_heads, codes.shape[-1],
                               device=s.device) for codes, _, _ in self._stores]
        self.listed(torch.zeros(2, s.num_layers, 3, dtype=torch.long, device=s.device),
                    torch.ones(2, s.num_layers, 3, device=s.device), weights, compile_now=True)
        self.tables(torch.zeros(2, 3, dtype=torch.long, device=s.device),
                    torch.ones(2, 3, device=s.device), weights, compile_now=True)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


def _inference(t: Tensor) -> Tensor:
    """`t` as an inference tensor (vLLM runs the engine in inference mode, so its tensors
    are; dynamo guards on the difference): a copy where it is not (a test's, say)."""
    return t if t.is_inference() else t.clone()


def flat(store_part: Tensor) -> Tensor:
    """[L, N, H, X] -> [L * N, H, X], a view (rows as `BlockSummaries.layer_rows` number
    them)."""
    return store_part.view(store_part.shape[0] * store_part.shape[1], *store_part.shape[2:])
