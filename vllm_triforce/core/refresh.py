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
    proposed: int = 0  # sums over `rounds`
    accepted: int = 0

    def acceptance(self) -> float | None:
        """Rolling acceptance over the recorded rounds (None before any proposal)."""
        return None if self.proposed == 0 else self.accepted / self.proposed


class RefreshPolicy:
    """Each call takes a batch's requests at once (their states, and one value each), so a
    step asks once, not once per request."""

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

    def due_at_start(self, states: list[RefreshState], num_committed: list[int]) -> list[bool]:
        """At a step's start, with num_committed[i] tokens of exact KV for states[i]."""
        interval, threshold, window = self.interval, self.acceptance_threshold, self.window
        out = []
        for state, committed in zip(states, num_committed):
            last = state.last_selection
            rate = state.acceptance() if threshold > 0 and len(state.rounds) >= window else None
            out.append(last is None or committed < last
                       or (interval > 0 and committed - last >= interval)
                       or (rate is not None and rate < threshold))
        return out

    def due_in_middle(self, states: list[RefreshState], prefixes: list[int]) -> list[bool]:
        """Between middle rounds, states[i]'s newest middle token at position
        prefixes[i] - 1."""
        if self.interval <= 0:
            return [False] * len(states)
        return [state.last_selection is not None
                and prefix - state.last_selection >= self.interval
                for state, prefix in zip(states, prefixes)]

    def record_selections(self, states: list[RefreshState], prefixes: list[int]) -> None:
        """states[i]'s request selected with the query of its token at position
        prefixes[i] - 1."""
        for state, prefix in zip(states, prefixes):
            state.last_selection = prefix
            state.rounds.clear()
            state.proposed = state.accepted = 0
            state.num_refreshes += 1

    def record_rounds(self, states: list[RefreshState], num_proposed: list[int],
                      num_accepted: list[int]) -> None:
        """One judged round each: num_proposed[i] tokens proposed to the level above,
        num_accepted[i] of them accepted (see the module docstring)."""
        for state, proposed, accepted in zip(states, num_proposed, num_accepted):
            if not 0 <= accepted <= proposed:
                raise ValueError(f"accepted {accepted} of {proposed} proposed tokens")
            rounds = state.rounds
            if len(rounds) == rounds.maxlen:  # the oldest leaves the window
                state.proposed -= rounds[0][0]
                state.accepted -= rounds[0][1]
            rounds.append((proposed, accepted))
            state.proposed += proposed
            state.accepted += accepted
