"""When to re-select the middle level's blocks.

The reference code (Infini-AI-Lab/TriForce) selects once per request, after prefill: its
re-selection path runs only on single-token target passes, and its loop always verifies
more than one token. Its blog suggests re-selecting "at regular intervals or adaptively
in response to a drop in the acceptance rate". We do both:

  * the first call for a request always refreshes (there is no selection yet);
  * every `interval` tokens since the last selection: at a step's start from the query of
    the newest committed token, and between middle rounds (`due_in_middle`) from the query
    of the newest middle token -- computed over the retrieval cache, so approximate, but
    current: a selection kept for a step's drafts was made for a query several tokens old
    (`bench acceptance` compares the two);
  * a selection made from a middle token's query whose token was then rejected
    (the committed prefix is shorter than the one it was made for) is replaced;
  * when the acceptance of the retrieval cache's judge falls below
    `acceptance_threshold`: accepted / proposed, rolled over the last `window` rounds
    since the last selection. A round is a middle-level round with three levels (the
    retrieval-cache target judging the small draft) and a full-cache verification with
    two (the full cache judging the retrieval cache's drafts). The window must fill after
    each selection first, so a refresh is judged on rounds that used the new selection.

Between refreshes new tokens enter the tail as recent blocks (tables.py).
interval <= 0 or acceptance_threshold <= 0 switches that trigger off.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RefreshState:
    """Per-request refresh bookkeeping."""
    last_selection: int | None = None  # prefix length whose last token's query selected
    rounds: deque = field(default_factory=deque)  # (num_proposed, num_accepted) since then
    num_refreshes: int = 0

    def acceptance(self) -> float | None:
        """Rolling acceptance over the recorded rounds (None before any proposal)."""
        proposed = sum(p for p, _ in self.rounds)
        return None if proposed == 0 else sum(a for _, a in self.rounds) / proposed


class RefreshPolicy:
    def __init__(self, interval: int, acceptance_threshold: float, window: int = 8):
        if window < 1:
            raise ValueError(f"refresh window must be >= 1 round, got {window}")
        if acceptance_threshold > 1:
            raise ValueError(f"acceptance_threshold is a rate in [0, 1], got {acceptance_threshold}")
        self.interval = interval
        self.acceptance_threshold = acceptance_threshold
        self.window = window

    def new_state(self) -> RefreshState:
        return RefreshState(rounds=deque(maxlen=self.window))

    def should_refresh(self, state: RefreshState, num_committed: int) -> bool:
        """At a step's start, with `num_committed` tokens of exact KV."""
        if state.last_selection is None or num_committed < state.last_selection:
            return True
        if self.interval > 0 and num_committed - state.last_selection >= self.interval:
            return True
        return self._acceptance_dropped(state)

    def due_in_middle(self, state: RefreshState, prefix: int) -> bool:
        """Between middle rounds, the newest middle token at position `prefix - 1`."""
        return (self.interval > 0 and state.last_selection is not None
                and prefix - state.last_selection >= self.interval)

    def _acceptance_dropped(self, state: RefreshState) -> bool:
        if self.acceptance_threshold <= 0 or len(state.rounds) < self.window:
            return False
        rate = state.acceptance()
        return rate is not None and rate < self.acceptance_threshold

    def record_selection(self, state: RefreshState, prefix: int) -> None:
        """A selection scored with the query of the token at position `prefix - 1`."""
        state.last_selection = prefix
        state.rounds.clear()
        state.num_refreshes += 1

    def record_round(self, state: RefreshState, num_proposed: int, num_accepted: int) -> None:
        """One judged round: num_proposed tokens proposed to the level above, num_accepted
        of them accepted (see the module docstring)."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposed tokens")
        state.rounds.append((num_proposed, num_accepted))
