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
        a = np.fromiter(self.values, dtype=np.float64, count=len(self.values))
        med = float(np.median(a))
        if len(a) < 3:
            return med, 0.0
        return med, MAD_TO_SIGMA * float(np.median(np.abs(np.diff(a)))) / math.sqrt(2.0)

    def robust(self) -> tuple[float, float]:
        """(median, 1.4826 * MAD) of the window."""
        a = np.fromiter(self.values, dtype=np.float64, count=len(self.values))
        med = float(np.median(a))
        return med, MAD_TO_SIGMA * float(np.median(np.abs(a - med)))


def log2_or_none(v: float):
    """log2 of a positive finite value, else None (zeros and non-finite values are not judged
    here: the range and nonfinite detectors own them)."""
    return math.log2(v) if v > 0 and math.isfinite(v) else None
