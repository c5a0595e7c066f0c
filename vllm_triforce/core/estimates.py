"""Online estimates the depth controller (core/controller.py) prices speculation with:
decayed lines for costs that grow with a size, decayed means, recent medians for costs a
one-off can spoil, and per-position acceptance counts."""

from __future__ import annotations

import itertools
import statistics
from collections import deque

import numpy as np


class DecayedLine:
    """y ~ a + b * x by exponentially decayed least squares (b >= 0: costs grow with x).

    With one distinct x seen so far the slope is `prior_slope`; before any sample,
    `predict` returns None. Once three samples are in, one above `outlier` times the
    prediction is dropped (a first call paying one-off set-up, a pause of the host) -- but
    three such samples in a row are a new regime (the host got busier): the line restarts
    from them, or it would never move again."""

    def __init__(self, decay: float = 0.95, prior_slope: float = 0.0, outlier: float = 3.0):
        self.decay = decay
        self.prior_slope = prior_slope
        self.outlier = outlier
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._outliers: list[tuple[float, float]] = []  # dropped samples, in a row

    def observe(self, x: float, y: float) -> None:
        if self.n >= 3 and y > self.outlier * max(self.predict(x), 1e-9):
            self._outliers.append((x, y))
            if len(self._outliers) < 3:
                return
            restart, self._outliers = self._outliers, []
            self.n, self.w, self.sx, self.sy, self.sxx, self.sxy = 0, 0.0, 0.0, 0.0, 0.0, 0.0
            for sample in restart:
                self.observe(*sample)
            return
        self._outliers = []
        self.n += 1
        d = self.decay
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    @property
    def seen(self) -> bool:
        return self.w > 0

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) or None before any sample."""
        if not self.seen:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        slope = self.prior_slope
        if var > 1e-9 * max(1.0, mx * mx):
            slope = max((self.sxy / self.w - mx * my) / var, 0.0)
        return my - slope * mx, slope

    def predict(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * x


class DecayedMean:
    def __init__(self, decay: float = 0.95, prior: float | None = None):
        self.decay, self.prior = decay, prior
        self.w = self.s = 0.0
        self.n = 0  # samples seen

    def observe(self, y: float, weight: float = 1.0) -> None:
        self.n += 1
        self.w = self.decay * self.w + weight
        self.s = self.decay * self.s + y * weight

    @property
    def value(self) -> float | None:
        return self.s / self.w if self.w > 0 else self.prior


class RecentMedian:
    """Median of the last `window` samples: a one-off cost (the first drafting step sets up
    per-layer metadata and selections) cannot dominate, as it would a mean."""

    def __init__(self, window: int = 9, prior: float = 0.0):
        self.samples: deque = deque(maxlen=window)
        self.prior = prior

    def observe(self, y: float) -> None:
        self.samples.append(y)

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else self.prior


class PositionAcceptance:
    """Decayed per-position counts: alpha_j = P(draft j accepted | drafts < j accepted).
    A position's counts decay only when a verification reaches it: a position no recent
    plan drafted to keeps what it last measured. Decayed at every verification instead,
    they would fade into the prior (0.6) while the controller drafts shallower, so deeper
    drafts would look worse the longer they go untried, and the controller would stay
    shallow for that reason alone."""

    def __init__(self, max_depth: int, decay: float = 0.98):
        self.decay = decay
        self.tried = np.zeros(max_depth)     # [max_depth] draft j reached the verifier
        self.accepted = np.zeros(max_depth)  # [max_depth] and was accepted

    def observe(self, num_verified, num_accepted) -> None:
        """Verifications in order, the i-th of num_verified[i] drafts that accepted the
        first num_accepted[i] (ints, or [n] arrays): the same counts as observing them one
        at a time, in one pass over the positions. A position reached by m of them decays
        by d**m; the i-th one that reaches it is weighted d**(those reaching it after i)."""
        reached, hit = _reached(np.atleast_1d(num_verified), np.atleast_1d(num_accepted),
                                len(self.tried))                   # [n, max_depth] each
        after = np.cumsum(reached[::-1], axis=0)[::-1] - reached   # reaching it later
        weight = np.where(reached, self.decay ** after, 0.0)
        kept = self.decay ** reached.sum(axis=0)
        self.tried = kept * self.tried + weight.sum(axis=0)
        self.accepted = kept * self.accepted + (weight * hit).sum(axis=0)

    def alphas(self, prior: np.ndarray, strength: float) -> np.ndarray:
        """Posterior means with `strength` pseudo-observations at `prior` per position."""
        return (self.accepted + strength * prior) / (self.tried + strength)


class RequestAcceptance:
    """`PositionAcceptance` for every live request at once: one row of counts per request
    (rows reused as requests leave), so a step's verifications update in one pass over
    the batch, not one Python loop per request. Each request is verified at most once a
    step."""

    def __init__(self, max_depth: int, decay: float = 0.98):
        self.decay = decay
        self.row_of: dict[str, int] = {}
        self.tried = np.zeros((0, max_depth))     # [rows, max_depth]
        self.accepted = np.zeros((0, max_depth))  # [rows, max_depth]
        self._free: list[int] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def accepted_of(self, req_id: str) -> np.ndarray:
        return self.accepted[self.row_of[req_id]]

    def tried_of(self, req_id: str) -> np.ndarray:
        return self.tried[self.row_of[req_id]]

    def observe(self, req_ids: list[str], num_verified: np.ndarray,
                num_accepted: np.ndarray) -> None:
        """Request req_ids[i] verified num_verified[i] drafts and accepted the first
        num_accepted[i] (distinct requests)."""
        rows = self._rows_of(req_ids)
        for i in np.flatnonzero(rows < 0).tolist():  # requests verified for the first time
            rows[i] = self._row(req_ids[i])
        reached, hit = _reached(num_verified, num_accepted, self.tried.shape[1])
        d = np.where(reached, self.decay, 1.0)
        self.tried[rows] = d * self.tried[rows] + reached
        self.accepted[rows] = d * self.accepted[rows] + hit

    def alphas(self, req_ids: list[str], prior: np.ndarray, strength: float) -> np.ndarray:
        """[R, max_depth]: each request's posterior means; `prior` for one never verified."""
        rows = self._rows_of(req_ids)
        seen = rows >= 0
        out = np.broadcast_to(prior, (len(req_ids), len(prior))).copy()
        if seen.any():
            r = rows[seen]
            out[seen] = (self.accepted[r] + strength * prior) / (self.tried[r] + strength)
        return out

    def retain(self, req_ids) -> None:
        """Forget every request not in `req_ids`."""
        for req_id in self.row_of.keys() - key_set(req_ids):
            self._free.append(self.row_of.pop(req_id))

    def _rows_of(self, req_ids: list[str]) -> np.ndarray:
        """[R] each request's row, -1 for one never verified (looked up by `map`, no Python
        line per request)."""
        return np.fromiter(map(self.row_of.get, req_ids, itertools.repeat(-1)),
                           dtype=np.int64, count=len(req_ids))

    def _row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is not None:
            return row
        if not self._free:  # double the table
            grow = max(8, len(self.tried))
            self._free = list(range(len(self.tried) + grow - 1, len(self.tried) - 1, -1))
            self.tried = np.concatenate([self.tried, np.zeros((grow, self.tried.shape[1]))])
            self.accepted = np.concatenate([self.accepted, np.zeros_like(self.tried[:grow])])
        row = self.row_of[req_id] = self._free.pop()
        self.tried[row] = 0.0
        self.accepted[row] = 0.0
        return row


def _reached(num_verified, num_accepted, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, max_depth] draft j reached the verifier, [n, max_depth] and was accepted) of
    verifications of num_verified[i] drafts accepting the first num_accepted[i]."""
    num_verified = np.asarray(num_verified, dtype=np.int64)[:, None]
    num_accepted = np.asarray(num_accepted, dtype=np.int64)[:, None]
    j = np.arange(max_depth)
    reached = (j < num_verified) & (j <= num_accepted)
    return reached, reached & (j < num_accepted)


def key_set(ids):
    """`ids` as a set-like view: a mapping's keys (vLLM's requests dict) as they are."""
    return ids.keys() if hasattr(ids, "keys") else set(ids)
