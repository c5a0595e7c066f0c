"""Online estimates the depth controller (core/controller.py) prices speculation with:
decayed lines for costs that grow with a size, decayed means, recent medians for costs a
one-off can spoil, and per-position acceptance counts."""

from __future__ import annotations

import statistics
from collections import deque


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
        self.tried = [0.0] * max_depth     # [max_depth] draft j reached the verifier
        self.accepted = [0.0] * max_depth  # [max_depth] and was accepted

    def observe(self, num_verified: int, num_accepted: int) -> None:
        """A verification of `num_verified` drafts that accepted the first `num_accepted`."""
        d = self.decay
        for j in range(min(num_verified, num_accepted + 1, len(self.tried))):  # reached
            self.tried[j] = d * self.tried[j] + 1
            self.accepted[j] = d * self.accepted[j] + (j < num_accepted)

    def alphas(self, prior: list[float], strength: float) -> list[float]:
        """Posterior means with `strength` pseudo-observations at `prior` per position."""
        return [(a + strength * p) / (t + strength)
                for a, t, p in zip(self.accepted, self.tried, prior)]
