"""The interface every block-scoring policy implements, and what all of them share.

A policy maps the query of each request's latest committed token to one score per
logical block and layer, higher = keep (`SelectionPolicy.block_scores`);
`selection.select_blocks` does the rest. `policies.py` lists the policies and builds one
by name; `SelectionState` is the per-request state a policy may keep (h2o's).

Shapes: query [num_reqs, num_layers, num_q_heads, head_dim] (post-RoPE);
block_table [num_reqs, max_blocks] physical ids; num_committed [num_reqs];
scores [num_reqs, num_layers, max_blocks] float32. GQA: query head h reads KV head
h // (num_q_heads // num_kv_heads), as in vLLM and HF (repeat_kv): `group_query`.

Aggregation: vLLM's kernels take one block table per layer, so per-head scores
[R, L, Hkv, G, B] become one score per block (`aggregate_heads`): "sum" over all query
heads, "max" over them (a block one head needs strongly wins), or "softmax" (each head's
scores normalised over the full committed blocks first, then summed: every head spends
one unit of mass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from vllm_triforce.core.policy_facts import POLICY_FACTS
from vllm_triforce.core.summaries import BlockSummaries

States = "SelectionState | Sequence[SelectionState | None] | None"


@dataclass
class SelectionState:
    """Per-request selection state: create it with the request, drop it with the request."""
    # [num_layers, num_logical_blocks] float32 attention mass accumulated per logical
    # block (h2o); grows as the request gets new blocks.
    block_mass: Tensor | None = None
    num_observed: int = 0  # queries accumulated into block_mass

    def accumulate(self, mass: Tensor) -> None:
        """mass [num_layers, num_blocks]: add one query's per-block attention mass."""
        if self.block_mass is None:
            self.block_mass = torch.zeros_like(mass)
        grow = mass.shape[-1] - self.block_mass.shape[-1]
        if grow > 0:
            self.block_mass = torch.nn.functional.pad(self.block_mass, (0, grow))
        self.block_mass[:, :mass.shape[-1]] += mass
        self.num_observed += 1

    def nbytes(self) -> int:
        return 0 if self.block_mass is None else self.block_mass.nbytes


def group_query(query: Tensor, num_kv_heads: int) -> Tensor:
    """[R, L, Hq, D] -> [R, L, Hkv, G, D] float32, G = Hq // Hkv query heads per KV head."""
    num_reqs, num_layers, num_q_heads, head_dim = query.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group onto {num_kv_heads} KV heads")
    return query.float().view(num_reqs, num_layers, num_kv_heads, -1, head_dim)


AGGREGATIONS = ("sum", "max", "softmax")


def aggregate_heads(per_head: Tensor, aggregation: str, candidates: Tensor) -> Tensor:
    """per_head [R, L, H, G, B] -> [R, L, B]; candidates [R, B] bool is the softmax domain."""
    if aggregation == "sum":
        return per_head.sum((2, 3))
    if aggregation == "max":
        return per_head.amax((2, 3))
    mask = candidates[:, None, None, None, :]
    probs = per_head.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs.sum((2, 3))


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")


class SelectionPolicy:
    """Base: one score per logical block and layer; higher = keep. A subclass registered in
    `policy_facts.POLICY_FACTS` under its `name` takes its flags from there."""
    name: str = ""
    needs_keys: bool = False  # reads BlockSummaries(keep_keys=True)
    needs_bounds: bool = False  # ... BlockSummaries(keep_bounds=True)
    needs_variance: bool = False  # ... BlockSummaries(keep_variance=True) (per instance)
    reranks_shortlist: bool = False  # implements `shortlist_scores`
    exact_stage: bool = False  # implements `exact_scores` (selection.rerank_exactly)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        facts = POLICY_FACTS.get(cls.name)
        if facts is not None:
            cls.needs_keys, cls.needs_bounds = facts.keeps_keys, facts.keeps_bounds
            cls.reranks_shortlist, cls.exact_stage = facts.reranks_shortlist, facts.exact_stage

    def block_scores(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                     num_committed: Tensor, state: States = None) -> Tensor:
        """[num_reqs, num_layers, max_blocks] float32."""
        raise NotImplementedError

    def observe(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                num_committed: Tensor, state: States = None) -> None:
        """See a query without selecting (only h2o accumulates anything)."""

    def shortlist_scores(self, query: Tensor, summaries: BlockSummaries, blocks: Tensor,
                         rows: Tensor | None = None, counts: Tensor | None = None,
                         copy: Tensor | None = None) -> Tensor:
        """blocks [R, L, S] physical ids per layer (-1: padding) -> [R, L, S] float32 scores
        of only those blocks (between middle rounds: selection.Shortlist). `rows`,
        `counts`: the blocks' `layer_rows` and token counts (>= 1), where the caller kept
        them (`Shortlist.summary_rows`); `copy`: what `listed_copy` made of them."""
        raise NotImplementedError(f"policy {self.name!r} does not re-rank a shortlist")

    def listed_copy(self, summaries: BlockSummaries, rows: Tensor,
                    counts: Tensor) -> Tensor | None:
        """The listed blocks' summaries as `shortlist_scores` reads them, copied once for a
        step's middle rounds, or None (no copy: each re-ranking reads the stores)."""
        return None

    def table_selection(self, query: Tensor, summaries: BlockSummaries, block_table: Tensor,
                        num_committed: Tensor, shortlist_size: int):
        """A step's selection made whole, query [R, L, Hq, D] to its selection.Choice (with
        each layer's best `shortlist_size` candidates as its Shortlist, summary rows read;
        0: none), where the policy has a kernel for it (`RetrievalPolicy`'s compiled one);
        None: the caller scores (`block_scores`) and selects (`select_blocks`) itself."""
        return None

    def listed_selection(self, query: Tensor, summaries: BlockSummaries,
                         shortlist) -> Tensor | None:
        """A shortlist's (selection.Shortlist, its summary rows read) re-ranking made whole,
        query [R, L, Hq, D] to its Selection's logical blocks [R, L, max_selected], where
        the policy has a kernel for it (`RetrievalPolicy`'s compiled one); None: the
        caller scores (`shortlist_scores`) and selects (`select_listed`) itself."""
        return None
