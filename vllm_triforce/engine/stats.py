"""TriForce's own counters: the levels vLLM's spec-decode metrics cannot see.

vLLM's `vllm:spec_decode_*` counters see only the top level (full-cache verification of
the gamma2 drafts). These add the middle level (small draft vs. target on the retrieval
cache), middle rounds, selection refreshes and draft re-bases. They live in the worker;
`snapshot()` is what the plugin reports through logs and (vllm_triforce/metrics.py)
Prometheus.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from vllm.logger import init_logger

logger = init_logger("vllm.triforce")

LOG_INTERVAL_S = 10.0

@dataclass
class TriForceStats:
    middle_proposed: int = 0   # level-1 tokens proposed to level 2
    middle_accepted: int = 0
    middle_rounds: int = 0     # batched level-2 passes
    refreshes: int = 0         # request-level re-selections of retrieval blocks
    draft_rebases: int = 0     # StreamingLLM window re-bases of the small draft
    summarised_blocks: int = 0  # full blocks whose summaries were set from the KV cache
    top_proposed: int = 0      # level-2 tokens verified by the full cache
    top_accepted: int = 0
    live_requests: int = 0     # gauge: requests holding per-request state
    middle_seconds: float = 0.0  # wall time inside the proposer (levels 1-2), cost model
    forward_seconds: float = 0.0  # of which: model forwards (levels 1-2), device-synchronised
    split_passes: int = 0      # passes split to fit max_num_batched_tokens (engine/device/forward.py)
    max_pass_tokens: int = 0   # gauge: the largest forward the proposer ran
    # round_graphs only (engine/device/round_graph.py): middle passes run over the
    # persistent buffers, and passes that fit no bucket (today's path instead); of the
    # passes, those loaded ahead, before the last round's copy to the host
    round_graph_passes: int = 0
    round_graph_misses: int = 0
    round_graph_ahead: int = 0
    # of those, replayed before that copy was waited for (VLLM_TRIFORCE_LAUNCH_AHEAD=1:
    # engine/retrieval_level.py `RetrievalStep.launch_ahead`)
    round_graph_launched_ahead: int = 0
    # of those, loaded with their re-selection as one graph (selection_graphs:
    # engine/device/selection_graph.py)
    round_graph_selections: int = 0
    # passes over a selection the step's start made (a step's first middle pass), laid
    # out and loaded as one graph (selection_graphs)
    round_graph_layouts: int = 0
    # plain steps decided on the host with no TriForce work at all (engine/plain_steps.py)
    host_plain_steps: int = 0
    # measure_middle_acceptance only: sum over measured positions of sum_x min(p, q), p the
    # full-cache and q the retrieval-cache distribution, and the number of positions.
    middle_pq_sum: float = 0.0
    middle_pq_count: int = 0
    # The depth controller (engine/depth.py): per decoding request and step, the number of
    # tokens handed to vLLM, as a histogram ([num_speculative_tokens + 1] counts, index =
    # depth); steps in which no request drafted; predicted and achieved tokens per second
    # (decayed means; achieved over whole cycles of vLLM's step plus the proposer's).
    depth_counts: list = field(default_factory=list)
    plain_steps: int = 0
    drafting_steps: int = 0
    predicted_tokens_per_s: float = 0.0
    achieved_tokens_per_s: float = 0.0
    _last_log: float = field(default_factory=time.monotonic, repr=False)

    def add(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            setattr(self, name, getattr(self, name) + amount)

    def record_middle(self, proposed: int, accepted: int) -> None:
        self.add(middle_proposed=proposed, middle_accepted=accepted)

    def record_verification(self, proposed: int, accepted: int) -> None:
        self.add(top_proposed=proposed, top_accepted=accepted)

    def record_depths(self, depths: list[int]) -> None:
        if not depths:
            return
        deepest = max(depths)
        self.depth_counts.extend([0] * max(deepest + 1 - len(self.depth_counts), 0))
        for k, n in Counter(depths).items():
            self.depth_counts[k] += n
        self.add(**{"drafting_steps" if deepest else "plain_steps": 1})

    def record_plain(self, decoding: int) -> None:
        """`record_depths([0] * decoding)`, a plain step's, without building the list."""
        if decoding:
            if not self.depth_counts:
                self.depth_counts.append(0)
            self.depth_counts[0] += decoding
            self.plain_steps += 1

    def snapshot(self) -> dict[str, int]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in asdict(self).items()
                if not k.startswith("_")}

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        logger.info("TriForce metrics: %s", format_snapshot(self.snapshot()))


def host_ms_per_round(s: dict) -> float:
    """Proposer time outside model forwards per middle round: the host work a GPU pays."""
    host = s["middle_seconds"] - s["forward_seconds"]
    return 1000.0 * host / s["middle_rounds"] if s["middle_rounds"] else float("nan")


def rate(accepted: int, proposed: int) -> float:
    return accepted / proposed if proposed else float("nan")


def format_snapshot(s: dict[str, int]) -> str:
    """The log line; fields that do not apply (no small draft, nothing verified yet,
    no middle round, no diagnostic) are left out rather than printed as nan."""
    parts = []
    if s["middle_proposed"]:
        parts.append(f"middle acceptance {rate(s['middle_accepted'], s['middle_proposed']):.3f}"
                     f" ({s['middle_accepted']}/{s['middle_proposed']})")
    if s["top_proposed"]:
        parts.append(f"full-cache acceptance {rate(s['top_accepted'], s['top_proposed']):.3f}"
                     f" ({s['top_accepted']}/{s['top_proposed']})")
    parts.append(f"middle rounds {s['middle_rounds']}, refreshes {s['refreshes']}")
    if s["draft_rebases"]:
        parts.append(f"draft re-bases {s['draft_rebases']}")
    if s["middle_rounds"]:
        parts.append(f"host ms per middle round {host_ms_per_round(s):.2f}")
    if s["plain_steps"] or s["drafting_steps"]:
        hist = " ".join(f"{k}:{n}" for k, n in enumerate(s["depth_counts"]) if n)
        parts.append(f"depth histogram {{{hist}}}, plain steps {s['plain_steps']}/"
                     f"{s['plain_steps'] + s['drafting_steps']}")
    if s["predicted_tokens_per_s"] or s["achieved_tokens_per_s"]:
        parts.append(f"tokens/s predicted {s['predicted_tokens_per_s']:.1f}, achieved "
                     f"{s['achieved_tokens_per_s']:.1f}")
    if s.get("middle_pq_count"):
        parts.append(f"retrieval-cache per-token acceptance sum min(p, q) "
                     f"{s['middle_pq_sum'] / s['middle_pq_count']:.3f} "
                     f"({s['middle_pq_count']} positions)")
    return ", ".join(parts)
