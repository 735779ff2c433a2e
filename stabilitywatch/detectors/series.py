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

    def median(self) -> float:
        """The median of the window (noise()'s first value)."""
        return _median(list(self.values))

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


class Rings:
    """The windows of many series (one per module...) as rows of one array, in the order their
    values came, NaN past each window's count: `noise` and `recent` of many series at once give
    exactly Window's values (the same float64 operations in the same order), without a Python
    median per series."""

    def __init__(self, size: int):
        self.w = size
        self.row: dict = {}
        self.vals = np.full((16, size), np.nan)
        self.count = np.zeros(16, dtype=np.int64)
        self.pos = np.zeros(16, dtype=np.int64)

    def rows(self, keys: list) -> np.ndarray:
        """The row of each series (made on first sight)."""
        out = np.empty(len(keys), dtype=np.int64)
        for j, k in enumerate(keys):
            r = self.row.get(k)
            if r is None:
                r = self.row[k] = len(self.row)
                if r >= self.vals.shape[0]:
                    self._grow(2 * self.vals.shape[0])
            out[j] = r
        return out

    def _grow(self, cap: int) -> None:
        n = self.vals.shape[0]
        vals = np.full((cap, self.w), np.nan)
        vals[:n] = self.vals
        count, pos = np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.int64)
        count[:n], pos[:n] = self.count, self.pos
        self.vals, self.count, self.pos = vals, count, pos

    def push(self, rows: np.ndarray, x: np.ndarray) -> None:
        """One value for each of the rows (distinct)."""
        self.vals[rows, self.pos[rows]] = x
        self.pos[rows] = (self.pos[rows] + 1) % self.w
        self.count[rows] = np.minimum(self.count[rows] + 1, self.w)

    def _ordered(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.count[rows]
        start = np.where(n == self.w, self.pos[rows], 0)
        idx = (start[:, None] + np.arange(self.w)) % self.w
        return self.vals[rows[:, None], idx], n

    def median(self, rows: np.ndarray) -> np.ndarray:
        """Window.noise's median alone (the order of the values does not matter to it)."""
        return _medians(self.vals[rows], self.count[rows])

    def noise(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window.noise of each row: (median, step-to-step noise)."""
        c, n = self._ordered(rows)
        med = _medians(c, n)
        d = c[:, 1:] - c[:, :-1]            # NaN past each window's last difference
        dn = np.maximum(n - 1, 0)
        dm = _medians(d, dn)
        with np.errstate(invalid="ignore"):
            mad = _medians(np.abs(d - dm[:, None]), dn)
        sigma = np.where(n < 3, 0.0, MAD_TO_SIGMA * mad / math.sqrt(2.0))
        return med, sigma

    def recent(self, rows: np.ndarray, k: int) -> np.ndarray:
        """Window.recent(k) of each row: the median of its last k values."""
        c, n = self._ordered(rows)
        first = np.maximum(n - k, 0)
        idx = first[:, None] + np.arange(k)
        last = np.take_along_axis(c, np.minimum(idx, self.w - 1), axis=1)
        last = np.where(idx < n[:, None], last, np.nan)
        return _medians(last, np.minimum(n, k))


def _medians(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per row, the median of its first n[i] values (the rest NaN), as _median: NaN sorts past
    the end; the two middle values averaged ((x + x) / 2 is x for an odd count)."""
    if a.shape[1] == 0:
        return np.full(a.shape[0], np.nan)
    s = np.sort(a, axis=1)
    lo = np.clip((n - 1) // 2, 0, a.shape[1] - 1)
    hi = np.clip(n // 2, 0, a.shape[1] - 1)
    idx = np.arange(a.shape[0])
    return np.where(n > 0, (s[idx, lo] + s[idx, hi]) / 2.0, np.nan)
