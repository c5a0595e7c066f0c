"""Exploration (issue 13, sixth sitting): which block score could close the SmolLM2 4K gap?

Runs `vllm-triforce bench acceptance` with extra columns that score blocks from the teacher's
copy of every committed key (they are measurements, not engine policies):

  sub{S}[_var]_{sum|softmax}  S-token sub-block centroids (mean, + per-channel variance): a
                              block's per-head log-mass = logsumexp over its sub-blocks of
                              q.mu + 1/2 q^2.var; aggregated over heads by sum or softmax.
  whole{S}[_pp]               the same estimate with each head's softmax over EVERY committed
                              block of the table (sinks, recent, partial tail included) --
                              the oracle's normalisation; S = 1 is exact (= the oracle);
                              `_pp`: exact query at every position.
  oracle_cand                 the per-position oracle with its softmax over full blocks only.

and, with PROTO_RECENT=N in the environment, a retrieval geometry of N recent blocks instead
of the engine's (the budget follows --budget-fraction). Usage (from the repo root):

    python benchmarks/explore/block_scores.py bench acceptance --out /tmp/explore \\
        --dtype float32 --context-tokens 4096 --policies topk_oracle_per_position \\
        streamingllm retrieval_var sub8_var_sum whole4_pp whole1_pp oracle_cand
    PROTO_RECENT=0 python benchmarks/explore/block_scores.py bench acceptance \\
        --out /tmp/explore_r0 --dtype float32 --context-tokens 4096 --budget-fraction 0.039

Results and reading: benchmarks/HISTORY.md, "What the SmolLM2 4K row needs".
"""

import math
import os
import sys

import torch

from vllm_triforce.core import policies, scoring
from vllm_triforce.core.blocks import full_block_mask
from vllm_triforce.core.key_policies import TopKOraclePolicy
from vllm_triforce.tools.bench import acceptance, teacher
from vllm_triforce.tools.cli import main


class SubBlockPolicy(scoring.SelectionPolicy):
    """Per head: logsumexp over S-token sub-blocks of q.mu (+ 1/2 q^2.var), from the key copy.
    whole=True: committed tokens of every table block, each head's softmax over all of them."""
    name = "explore_subblock"
    needs_keys = True

    def __init__(self, sub=8, variance=False, aggregation="sum", whole=False):
        self.sub, self.variance, self.aggregation, self.whole = sub, variance, aggregation, whole

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        q = scoring.group_query(query, summaries.num_kv_heads)  # [R, L, H, G, D]
        q = q / math.sqrt(q.shape[-1])
        ids = block_table.long().clamp(min=0)
        num_reqs, num_layers, heads, group, _ = q.shape
        bs, blocks = summaries.block_size, ids.shape[1]
        parts = bs // self.sub
        token = torch.arange(blocks * bs).view(1, blocks, parts, self.sub)
        weight = (token < num_committed.view(-1, 1, 1, 1)).float()  # [R, B, P, sub]
        count = weight.sum(-1)  # [R, B, P]
        out = torch.empty(num_reqs, num_layers, heads, group, blocks)
        for layer in range(num_layers):
            keys = summaries.keys[layer][ids].float()  # [R, B, bs, H, D]
            keys = keys.view(num_reqs, blocks, parts, self.sub, *keys.shape[-2:])
            w = weight[..., None, None]
            mean = (keys * w).sum(3) / count.clamp(min=1)[..., None, None]  # [R, B, P, H, D]
            score = torch.einsum("rhgd,rbphd->rhgbp", q[:, layer], mean)
            if self.variance:
                var = ((keys - mean[:, :, :, None]).square() * w).sum(3)
                var = var / count.clamp(min=1)[..., None, None]
                score = score + 0.5 * torch.einsum("rhgd,rbphd->rhgbp", q[:, layer].square(), var)
            if self.whole:
                score = score + count.log()[:, None, None]  # empty sub-blocks: -inf
            out[:, layer] = score.logsumexp(-1)
        if self.whole:
            return out.softmax(-1).nan_to_num(0.0).sum((2, 3))
        candidates = full_block_mask(num_committed, bs, blocks)
        return scoring.aggregate_heads(out, self.aggregation, candidates)


class CandidateOracle(TopKOraclePolicy):
    """Exact mass, each head's softmax over the full blocks only (no partial tail)."""
    name = "explore_oracle_cand"

    def block_scores(self, query, summaries, block_table, num_committed, state=None):
        q = scoring.group_query(query, summaries.num_kv_heads) / math.sqrt(query.shape[-1])
        ids = block_table.long().clamp(min=0)
        full = full_block_mask(num_committed, summaries.block_size, ids.shape[1])
        out = torch.zeros(*q.shape[:2], ids.shape[1])
        for layer in range(q.shape[1]):
            logits = torch.einsum("rhgd,rbthd->rhgbt", q[:, layer],
                                  summaries.keys[layer][ids].float())
            logits = logits.masked_fill(~full[:, None, None, :, None], float("-inf"))
            probs = logits.flatten(3).softmax(-1).nan_to_num(0.0).view(logits.shape)
            out[:, layer] = probs.sum((1, 2, 4))
        return out


def register() -> None:
    policies.POLICIES[SubBlockPolicy.name] = SubBlockPolicy
    policies.POLICIES[CandidateOracle.name] = CandidateOracle
    step, middle, per_position = acceptance.STEP, acceptance.MIDDLE, acceptance.PER_POSITION
    columns = acceptance.COLUMNS
    for sub in (16, 8, 4):
        for variance in (False, True):
            for aggregation in ("sum", "softmax"):
                name = f"sub{sub}{'_var' if variance else ''}_{aggregation}"
                columns[name] = (SubBlockPolicy.name, {"sub": sub, "variance": variance,
                                                       "aggregation": aggregation},
                                 step, middle, f"{sub}-token sub-blocks, {name}")
    for sub in (32, 16, 8, 4):
        columns[f"whole{sub}"] = (SubBlockPolicy.name, {"sub": sub, "variance": True,
                                                        "whole": True},
                                  step, middle, f"whole-table softmax, {sub}-token sub-blocks")
    for sub in (32, 4, 1):
        columns[f"whole{sub}_pp"] = (SubBlockPolicy.name, {"sub": sub, "variance": sub > 1,
                                                           "whole": True},
                                     per_position, False,
                                     f"whole-table softmax, {sub}-token sub-blocks, per position")
    columns["oracle_cand"] = (CandidateOracle.name, {}, per_position, False,
                              "Top-K oracle over full blocks only, per position")
    if "PROTO_RECENT" in os.environ:
        recent = int(os.environ["PROTO_RECENT"])
        init = teacher.TeacherForcedEngine.__init__

        def with_geometry(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.geometry = teacher.Geometry(self.geometry.block_size,
                                             self.geometry.sink_blocks, recent)

        teacher.TeacherForcedEngine.__init__ = with_geometry


if __name__ == "__main__":
    register()
    sys.exit(main())
