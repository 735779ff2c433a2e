"""Rolling windows and robust scores shared by the drift, spike and shadow detectors (host side,
numpy, one small array per series)."""
from __future__ import annotations

import math
from collections import deque
from statistics import NormalDist

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class Window:
    """The last `size` values of one series, with a frozen early baseline (the median of the
    first `early` values) for detectors that judge growth from the start of training."""

    __slots__ = ("values", "early", "n_early", "baseline", "seen")

    def __init__(self, size: int, early: int = 0):
        self.values: deque = deque(maxlen=size)
        self.early: list = []
        self.n_early = early
        self.baseline = math.nan
        self.seen = 0

    def __len__(self) -> int:
        return len(self.values)

    def push(self, x: float) -> None:
        self.values.append(x)
        self.seen += 1
        if len(self.early) < self.n_early:
            self.early.append(x)
            if len(self.early) == self.n_early:
                self.baseline = float(np.median(self.early))

    def noise(self) -> tuple[float, float]:
        """(median, step-to-step noise): 1.4826 * MAD of the successive differences about their
        median, / sqrt(2). A trend (a loss going down) shifts the differences without spreading
        them, so it does not inflate the noise the way a MAD about the median does."""
        a = list(self.values)
        med = _median(a)
        if len(a) < 3:
            return med, 0.0
        diffs = [b - c for b, c in zip(a[1:], a[:-1])]
        dm = _median(diffs)
        return med, MAD_TO_SIGMA * _median([abs(d - dm) for d in diffs]) / math.sqrt(2.0)

    def recent(self, k: int) -> float:
        """Median of the last k values: the series' current level while it trends."""
        return _median(list(self.values)[-k:])


def _median(values: list) -> float:
    # plain Python on these short windows: numpy's per-call overhead was most of the drift
    # detector's time (one call per series per frame); same result as np.median
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return float(s[mid]) if n % 2 else (s[mid - 1] + s[mid]) / 2.0


def log2_or_none(v: float):
    """log2 of a positive finite value, else None (zeros and non-finite values are not judged
    here: the range and nonfinite detectors own them)."""
    return math.log2(v) if v > 0 and math.isfinite(v) else None


def theil_sen(y: np.ndarray, x: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(slope, lower, upper): the median of the pairwise slopes and Sen's (1968, eq. 2.6)
    confidence interval of it, with ties in x and y, as scipy.stats.theilslopes gives them."""
    dx = x[:, None] - x
    dy = y[:, None] - y
    pos = dx > 0
    slopes = np.sort(dy[pos] / dx[pos])
    nt = len(slopes)
    if nt == 0:
        return math.nan, math.nan, math.nan
    alpha = 1.0 - confidence if confidence > 0.5 else confidence
    z = NormalDist().inv_cdf(alpha / 2.0)
    n = len(y)
    ties = sum(k * (k - 1) * (2 * k + 5) for v in (x, y) for k in _repeats(v))
    sigma = math.sqrt(max(0.0, (n * (n - 1) * (2 * n + 5) - ties) / 18.0))
    hi = min(int(np.round((nt - z * sigma) / 2.0)), nt - 1)
    lo = max(int(np.round((nt + z * sigma) / 2.0)) - 1, 0)
    return float(np.median(slopes)), float(slopes[lo]), float(slopes[hi])


def _repeats(v: np.ndarray) -> list[int]:
    _, counts = np.unique(v, return_counts=True)
    return [int(c) for c in counts if c > 1]
