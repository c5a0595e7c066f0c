"""What each selection policy keeps and does, in one table that imports nothing.

Config validation (`config.py`, which must not import torch), the memory plan reserved
before vLLM sizes its KV cache (`engine/memory.py`) and the allocation of the block
summaries (`engine/proposer.py`) all read `summary_kinds` below, so the bytes reserved
are the bytes allocated (tests/core/test_core_policy_facts.py checks it for every policy).
The policies themselves are in `summary_policies.py` and `key_policies.py`; `POLICIES` in
`policies.py` is keyed by these names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyFacts:
    name: str
    # Keeps a copy of every committed key (`SummaryKinds.keep_keys`: as much memory as the
    # key cache): refused unless the user sets `allow_full_key_copy` (benchmarks).
    keeps_keys: bool = False
    # Keeps per-block per-channel key minima and maxima (two key-sized vectors per block).
    keeps_bounds: bool = False
    # `key_variance` applies: with it, one key-sized vector per block more (coded, a byte
    # a value, by default; float32 with `compact_summaries` false; with
    # `compact_key_variance`, 8 values per KV head in the summaries' dtype).
    takes_key_variance: bool = False
    # Between middle rounds, re-ranks the step start's shortlist (`middle_shortlist`).
    reranks_shortlist: bool = False
    # Has a second, exact stage: its first stage's best candidates re-ranked by their exact
    # attention mass over keys read from a key source (core/selection.py `rerank_exactly`;
    # in the engine vLLM's KV cache, engine/paged_keys.py); without one, its first stage.
    exact_stage: bool = False


POLICY_FACTS: dict[str, PolicyFacts] = {f.name: f for f in (
    PolicyFacts("retrieval", takes_key_variance=True, reranks_shortlist=True),
    PolicyFacts("quest", keeps_bounds=True),
    PolicyFacts("streamingllm"),
    PolicyFacts("h2o", keeps_keys=True),
    PolicyFacts("topk_oracle", keeps_keys=True),
    # Its first stage is `retrieval`; its exact stage reads vLLM's own KV cache, so no copy.
    PolicyFacts("rerank", takes_key_variance=True, exact_stage=True),
)}
POLICY_NAMES = tuple(POLICY_FACTS)


@dataclass(frozen=True)
class SummaryKinds:
    """Which optional state `core.summaries.BlockSummaries` keeps (its keep_* arguments)."""
    keep_keys: bool = False
    keep_bounds: bool = False
    keep_variance: bool = False
    compact_variance: bool = False  # the variance per band of channels (core/summaries.py)
    coded: bool = False  # key sums and variance in one byte a value (core/summary_coding.py)


def summary_kinds(policy: str, key_variance: bool, compact_key_variance: bool = False,
                  compact_summaries: bool = False) -> SummaryKinds:
    """The block state policy `policy` reads, `key_variance`, `compact_key_variance` and
    `compact_summaries` as configured."""
    facts = POLICY_FACTS[policy]
    keep_variance = facts.takes_key_variance and key_variance
    return SummaryKinds(keep_keys=facts.keeps_keys, keep_bounds=facts.keeps_bounds,
                        keep_variance=keep_variance,
                        compact_variance=keep_variance and compact_key_variance,
                        coded=compact_summaries and not (keep_variance and compact_key_variance))
