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

import numpy as np


class RefreshPolicy:
    """Every live request's refresh bookkeeping, as arrays with one row per request: its
    state is that row (`new_state` hands one out, `release` takes it back). Each call
    takes a batch's requests at once (their states, and one value each, as sequences or
    numpy arrays): a step asks once, and the work is array work, not a loop over requests.

    A request's row holds the prefix length whose last token's query selected
    (`last_selection`, -1 before any selection), the last `window` judged rounds since
    then (a ring of (proposed, accepted)), their sums, and how many selections it made."""

    _ROWS = ("last_selection", "_ring", "_held", "_head", "_proposed", "_accepted",
             "_num_refreshes")

    def __init__(self, interval: int, acceptance_threshold: float, window: int = 8):
        if window < 1:
            raise ValueError(f"refresh window must be >= 1 round, got {window}")
        if acceptance_threshold > 1:
            raise ValueError(f"acceptance_threshold is a rate in [0, 1], got {acceptance_threshold}")
        self.interval = interval
        self.acceptance_threshold = acceptance_threshold
        self.window = window
        self._free: list[int] = []
        # one row per request (filled in by `new_state`): last selection, the ring's
        # (proposed, accepted) per round, rounds held, the ring's next slot, their sums,
        # selections made
        self.last_selection = np.zeros(0, dtype=np.int64)
        self._ring = np.zeros((0, window, 2), dtype=np.int64)
        self._held, self._head, self._proposed, self._accepted, self._num_refreshes = (
            np.zeros(0, dtype=np.int64) for _ in range(5))
        self._grow(16)

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` requests; the new rows are free."""
        old = self.last_selection.shape[0]
        for name in self._ROWS:
            array = getattr(self, name)
            grown = np.zeros((capacity, *array.shape[1:]), dtype=np.int64)
            grown[:old] = array
            setattr(self, name, grown)
        self._free.extend(range(capacity - 1, old - 1, -1))

    def new_state(self) -> int:
        """A row for a new request: no selection yet, no rounds."""
        if not self._free:
            self._grow(2 * self.last_selection.shape[0])
        row = self._free.pop()
        self.last_selection[row] = -1
        self._num_refreshes[row] = 0
        self._clear(row)
        return row

    def release(self, states) -> None:
        """Rows of requests that are gone, free for new ones."""
        self._free.extend(int(s) for s in states)

    def _clear(self, rows) -> None:
        self._held[rows] = 0
        self._head[rows] = 0
        self._proposed[rows] = 0
        self._accepted[rows] = 0

    def acceptance(self, state: int) -> float | None:
        """Rolling acceptance over the recorded rounds (None before any proposal)."""
        proposed = int(self._proposed[state])
        return None if proposed == 0 else int(self._accepted[state]) / proposed

    def num_refreshes(self, state: int) -> int:
        return int(self._num_refreshes[state])

    def due_at_start(self, states, num_committed) -> np.ndarray:
        """At a step's start, with num_committed[i] tokens of exact KV for states[i]."""
        rows = np.asarray(states, dtype=np.int64)
        committed = np.asarray(num_committed, dtype=np.int64)
        last = self.last_selection[rows]
        due = (last < 0) | (committed < last)
        if self.interval > 0:
            due |= committed - last >= self.interval
        if self.acceptance_threshold > 0:
            proposed = self._proposed[rows]
            judged = (self._held[rows] >= self.window) & (proposed > 0)
            rate = self._accepted[rows] / np.maximum(proposed, 1)
            due |= judged & (rate < self.acceptance_threshold)
        return due

    def due_in_middle(self, states, prefixes) -> np.ndarray:
        """Between middle rounds, states[i]'s newest middle token at position
        prefixes[i] - 1."""
        rows = np.asarray(states, dtype=np.int64)
        if self.interval <= 0:
            return np.zeros(rows.shape[0], dtype=bool)
        last = self.last_selection[rows]
        return (last >= 0) & (np.asarray(prefixes, dtype=np.int64) - last >= self.interval)

    def record_selections(self, states, prefixes) -> None:
        """states[i]'s request selected with the query of its token at position
        prefixes[i] - 1 (each request once per call)."""
        rows = np.asarray(states, dtype=np.int64)
        self.last_selection[rows] = np.asarray(prefixes, dtype=np.int64)
        self._clear(rows)
        self._num_refreshes[rows] += 1

    def record_rounds(self, states, num_proposed, num_accepted) -> None:
        """One judged round each (each request once per call): num_proposed[i] tokens
        proposed to the level above, num_accepted[i] of them accepted (see the module
        docstring)."""
        rows = np.asarray(states, dtype=np.int64)
        proposed = np.asarray(num_proposed, dtype=np.int64)
        accepted = np.asarray(num_accepted, dtype=np.int64)
        bad = (accepted < 0) | (accepted > proposed)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"accepted {accepted[i]} of {proposed[i]} proposed tokens")
        head = self._head[rows]
        full = self._held[rows] == self.window  # the oldest (at head) leaves the window
        oldest = self._ring[rows, head]
        self._proposed[rows] += proposed - np.where(full, oldest[:, 0], 0)
        self._accepted[rows] += accepted - np.where(full, oldest[:, 1], 0)
        self._ring[rows, head, 0] = proposed
        self._ring[rows, head, 1] = accepted
        self._head[rows] = (head + 1) % self.window
        self._held[rows] = np.minimum(self._held[rows] + 1, self.window)
