"""The block-scoring policies of the paper's comparisons, by name: `make_policy`.

Every policy implements `scoring.SelectionPolicy`: one score per logical block and layer
from the query of each request's latest committed token, higher = keep;
`selection.Selector` chooses the blocks from the scores.

  retrieval    TriForce: query . mean post-RoPE key of the block   summary_policies.py
               (+ the keys' per-channel variance, `variance`)
  quest        Quest: an upper bound of q . k from key bounds      summary_policies.py
  streamingllm sinks + the most recent blocks                      summary_policies.py
  topk_oracle  exact attention mass per block (reads every key)    key_policies.py
  h2o          the oracle's mass accumulated over the queries      key_policies.py
  rerank       retrieval shortlists, exact attention mass decides  key_policies.py

What each policy keeps and needs (no torch) is `policy_facts.py`'s.
"""

from __future__ import annotations

from vllm_triforce.core.key_policies import H2OPolicy, RerankPolicy, TopKOraclePolicy
from vllm_triforce.core.scoring import SelectionPolicy
from vllm_triforce.core.summary_policies import QuestPolicy, RetrievalPolicy, StreamingLLMPolicy


POLICIES: dict[str, type[SelectionPolicy]] = {
    cls.name: cls for cls in (RetrievalPolicy, QuestPolicy, StreamingLLMPolicy, H2OPolicy,
                              TopKOraclePolicy, RerankPolicy)
}


def make_policy(name: str, **kwargs) -> SelectionPolicy:
    """The policy registered under `name`, constructed with kwargs."""
    if name not in POLICIES:
        raise ValueError(f"unknown selection policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
