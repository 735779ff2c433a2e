"""Rolling windows and robust scores shared by the drift, spike and shadow detectors (host side,
numpy, one small array per series)."""
from __future__ import annotations

import math
from collections import deque

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
        """(median, step-to-step noise): 1.4826 * MAD of successive differences / sqrt(2). A
        trend (a loss going down) does not inflate it the way a MAD about the median does."""
        a = list(self.values)
        med = _median(a)
        if len(a) < 3:
            return med, 0.0
        diffs = [abs(b - c) for b, c in zip(a[1:], a[:-1])]
        return med, MAD_TO_SIGMA * _median(diffs) / math.sqrt(2.0)


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
