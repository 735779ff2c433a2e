"""Host-side values derived from a statistics row (numpy)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import numpy as np

from ..formats import FORMATS, ROW_FORMATS
from .layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, Stat, shift_is_set
from .scale import effective_scale, effective_scales

COUNT_KEYS = {"numel": Stat.NUMEL, "nan": Stat.NAN, "posinf": Stat.POSINF,
              "neginf": Stat.NEGINF, "zeros": Stat.ZEROS}


def finite_count(row: np.ndarray) -> float:
    return float(row[Stat.NUMEL] - row[Stat.NAN] - row[Stat.POSINF] - row[Stat.NEGINF])


def derive(row: np.ndarray, scale: float = 1.0) -> dict[str, float]:
    """Named values of one row. Value statistics (sum and l2norm included) cover finite values
    only and are NaN when there are none; std is the population standard deviation (ddof=0).
    The headroom uses the scale as the format counts do (stats/scale.py)."""
    return dict(derive_many(np.asarray(row, dtype=np.float64).reshape(1, N_STATS), [scale])[0])


def derive_many(rows: np.ndarray, scales) -> list[dict[str, float]]:
    """derive() for every row of a frame at once (read-only mappings over shared columns)."""
    table, _, hists = derive_table(rows, scales)
    return [DerivedRow(table, i, hists) for i in range(len(hists))]


SMALL = 2   # frames of at most this many rows (the loss alone) take the scalar path


def derive_table(rows: np.ndarray, scales) -> tuple[dict, Optional[dict], np.ndarray]:
    """(table, arrays, hists): the named values of every row as columns (a `Columns`: name ->
    list of Python floats, one per row, each made on first read), the same columns as numpy
    arrays (None for a frame of at most
    SMALL rows, whose values are worked out one by one: ~60 numpy calls on a single row cost
    more than the loss row's whole frame may), and the rows' exponent histograms (read-only)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, N_STATS)
    if rows.shape[0] <= SMALL:
        # effective_scale, one by one: the same values as effective_scales' array operations
        table = Columns(_derive_scalar(rows, [effective_scale(s) for s in scales]))
        arrays = None
    else:
        arrays = _derive_arrays(rows, effective_scales(scales).reshape(-1))
        table = Columns(None, arrays)
    hists = rows[:, Stat.HIST: Stat.HIST + HIST_BINS]  # a view: the frame's rows are its own
    hists.flags.writeable = False
    return table, arrays, hists


def _derive_arrays(rows: np.ndarray, scale: np.ndarray) -> dict[str, np.ndarray]:
    nan = np.nan
    cols: dict[str, np.ndarray] = {k: rows[:, i] for k, i in COUNT_KEYS.items()}
    n = rows[:, Stat.NUMEL] - rows[:, Stat.NAN] - rows[:, Stat.POSINF] - rows[:, Stat.NEGINF]
    has = n > 0
    safe_n = np.where(has, n, 1.0)
    with np.errstate(all="ignore"):
        cols["finite"] = n
        cols["min"] = np.where(has, rows[:, Stat.MIN], nan)
        cols["max"] = np.where(has, rows[:, Stat.MAX], nan)
        absmax = np.where(has, rows[:, Stat.ABSMAX], nan)
        cols["absmax"] = absmax
        nz = rows[:, Stat.ABSMIN_NZ]
        cols["absmin_nonzero"] = np.where(np.isfinite(nz), nz, nan)
        cols["sum"] = np.where(has, rows[:, Stat.SUM], nan)  # the row keeps 0: it merges
        mean = np.where(has, rows[:, Stat.SUM] / safe_n, nan)
        ms = np.where(has, rows[:, Stat.SUMSQ] / safe_n, nan)
        cols["mean"] = mean
        # from the shifted sums (precise when the mean is large against the spread); a row
        # made by hand without them (its shift unset) from the plain ones
        dm = rows[:, Stat.SHIFT_SUM] / safe_n
        var = np.where(shift_is_set(rows[:, Stat.SHIFT]),
                       rows[:, Stat.SHIFT_SUMSQ] / safe_n - dm * dm, ms - mean * mean)
        cols["std"] = np.where(has, np.sqrt(np.maximum(var, 0.0)), nan)
        cols["rms"] = np.where(has, np.sqrt(ms), nan)
        cols["l2norm"] = np.where(has, np.sqrt(rows[:, Stat.SUMSQ]), nan)
        nonzero = n - rows[:, Stat.ZEROS]
        amax_s = absmax * scale
        for fmt in ROW_FORMATS:
            base, name = FMT_BASE[fmt], fmt.value
            over, under = rows[:, base], rows[:, base + 1]
            cols[f"{name}_overflow"] = over
            cols[f"{name}_underflow"] = under
            cols[f"{name}_subnormal"] = rows[:, base + 2]
            cols[f"{name}_overflow_frac"] = np.where(has, over / safe_n, 0.0)
            cols[f"{name}_underflow_frac"] = np.where(nonzero > 0, under / np.where(
                nonzero > 0, nonzero, 1.0), 0.0)
            cols[f"{name}_headroom_bits"] = np.where(
                has & (amax_s > 0), math.log2(FORMATS[fmt].max) - np.log2(amax_s), nan)
        cols["dynamic_range_bits"] = np.where(has & (absmax > 0) & np.isfinite(nz),
                                              np.log2(absmax) - np.log2(nz), nan)
    return cols


def _sqrt(v: float) -> float:
    return math.sqrt(v) if v >= 0 else math.nan   # np.sqrt's NaN for a negative (or NaN) value


def _derive_scalar(rows: np.ndarray, scales: list) -> dict[str, list]:
    """_derive_arrays, value by value, with the same float64 operations in the same order (so
    the same results; log2 is numpy's, whose results differ from math.log2's in the last bit).
    `scales`: the rows' effective scales (Python floats)."""
    nan, isfinite, log2 = math.nan, math.isfinite, np.log2
    got = []
    for r, scale in zip(rows.tolist(), scales):   # sync-ok: host numpy arrays
        n = r[_NUMEL] - r[_NAN] - r[_POSINF] - r[_NEGINF]
        has = n > 0
        safe_n = n if has else 1.0
        absmax = r[_ABSMAX] if has else nan
        nz = r[_ABSMIN_NZ]
        mean = r[_SUM] / safe_n if has else nan
        ms = r[_SUMSQ] / safe_n if has else nan
        shift = r[_SHIFT]
        if not (shift == 0 and math.copysign(1.0, shift) < 0):   # layout.shift_is_set
            dm = r[_SHIFT_SUM] / safe_n
            var = r[_SHIFT_SUMSQ] / safe_n - dm * dm
        else:
            var = ms - mean * mean
        nonzero = n - r[_ZEROS]
        amax_s = absmax * scale
        logs = np.array([amax_s, absmax, nz])
        if amax_s > 0 and absmax > 0 and nz > 0:   # no warning to silence (NaN fails these)
            l_amax_s, l_absmax, l_nz = log2(logs).tolist()   # sync-ok: host floats
        else:
            with np.errstate(all="ignore"):
                l_amax_s, l_absmax, l_nz = log2(logs).tolist()   # sync-ok: host floats
        vals = [r[_NUMEL], r[_NAN], r[_POSINF], r[_NEGINF], r[_ZEROS],
                n, r[_MIN] if has else nan, r[_MAX] if has else nan, absmax,
                nz if isfinite(nz) else nan, r[_SUM] if has else nan, mean,
                _sqrt(var if var > 0 or var != var else 0.0) if has else nan,   # np.maximum
                _sqrt(ms) if has else nan, _sqrt(r[_SUMSQ]) if has else nan]
        for base, top in _FMT_PARTS:
            over, under = r[base], r[base + 1]
            vals += [over, under, r[base + 2], over / safe_n if has else 0.0,
                     under / nonzero if nonzero > 0 else 0.0,
                     top - l_amax_s if has and amax_s > 0 else nan]
        vals.append(l_absmax - l_nz if has and absmax > 0 and isfinite(nz) else nan)
        got.append(vals)
    return {k: list(col) for k, col in zip(NAMES, zip(*got))}


_NUMEL, _NAN, _POSINF, _NEGINF, _ZEROS = (int(Stat.NUMEL), int(Stat.NAN), int(Stat.POSINF),
                                          int(Stat.NEGINF), int(Stat.ZEROS))
_MIN, _MAX, _ABSMAX, _ABSMIN_NZ = int(Stat.MIN), int(Stat.MAX), int(Stat.ABSMAX), \
    int(Stat.ABSMIN_NZ)
_SUM, _SUMSQ, _SHIFT, _SHIFT_SUM, _SHIFT_SUMSQ = (int(Stat.SUM), int(Stat.SUMSQ),
                                                  int(Stat.SHIFT), int(Stat.SHIFT_SUM),
                                                  int(Stat.SHIFT_SUMSQ))
# per format: (its first count's column, log2 of its max)
_FMT_PARTS = tuple((FMT_BASE[f], math.log2(FORMATS[f].max)) for f in ROW_FORMATS)


# the derived values' names, in the order records carry them
NAMES = tuple(COUNT_KEYS) + ("finite", "min", "max", "absmax", "absmin_nonzero", "sum", "mean",
                             "std", "rms", "l2norm") + tuple(
    f"{f.value}_{k}" for f in ROW_FORMATS for k in ("overflow", "underflow", "subnormal",
                                                    "overflow_frac", "underflow_frac",
                                                    "headroom_bits")) + ("dynamic_range_bits",)


class Columns(dict):
    """name -> list of one value per row, in NAMES order. From column arrays, a list is made
    (tolist) when first read: a frame's ~22,000 values become Python floats only where a
    reader needs them (the JSONL sink ships the arrays to its writer process as they are)."""

    __slots__ = ("arrays", "_full")

    def __init__(self, lists: "dict | None" = None, arrays: "dict | None" = None):
        super().__init__(lists or {})
        self.arrays = arrays
        self._full: Optional[dict] = None

    def __missing__(self, key: str) -> list:
        if self.arrays is None:
            raise KeyError(key)
        col = self[key] = self.arrays[key].tolist()  # sync-ok: host numpy arrays
        return col

    def full(self) -> dict:
        """Every column, in NAMES order (made once)."""
        if self._full is None:
            self._full = {k: self[k] for k in NAMES}
        return self._full


class DerivedRow(Mapping):
    """One row's named values, read from the frame's shared columns: building a dict per row was
    most of the frame's host time; sinks iterate it later, on their own thread."""

    __slots__ = ("_cols", "_i", "_hists")

    def __init__(self, cols: dict, i: int, hists: "np.ndarray | None" = None):
        self._cols, self._i, self._hists = cols, i, hists

    def __getitem__(self, key: str) -> float:
        return self._cols[key][self._i]

    def __iter__(self):
        # a Columns table holds the lists read so far; its names are NAMES
        return iter(NAMES if type(self._cols) is Columns else self._cols)

    def __len__(self) -> int:
        return len(NAMES if type(self._cols) is Columns else self._cols)

    def column(self, key: str) -> list:
        """This value for every row of the frame (the shared column)."""
        return self._cols[key]

    def to_dict(self) -> dict:
        """dict(self), made in one comprehension (not a __getitem__ call per key)."""
        cols, i = self._cols, self._i
        if type(cols) is Columns:
            return {k: cols[k][i] for k in NAMES}
        return {k: v[i] for k, v in cols.items()}

    @property
    def table(self) -> dict:
        """The frame's shared columns (name -> list of values, one per row)."""
        return self._cols.full() if isinstance(self._cols, Columns) else self._cols

    @property
    def columns(self) -> Mapping:
        """The frame's shared columns object, as it is (lists made as they are read)."""
        return self._cols

    @property
    def arrays(self) -> "dict | None":
        """The frame's shared columns as float64 arrays (None for a frame of at most SMALL
        rows), read-only."""
        return self._cols.arrays if isinstance(self._cols, Columns) else None

    @property
    def index(self) -> int:
        """This row's position in the columns."""
        return self._i

    @property
    def hist(self) -> "np.ndarray | None":
        """The row's exponent histogram counts (layout.HIST_*; not one of the mapping's keys,
        so stats.jsonl leaves it out), read-only."""
        return None if self._hists is None else self._hists[self._i]

    def __repr__(self) -> str:
        return repr(dict(self))


def histogram(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, counts): counts[i] values with floor(log2|x|) == exponents[i] (end bins open)."""
    counts = np.asarray(row, dtype=np.float64)[Stat.HIST: Stat.HIST + HIST_BINS]
    return np.arange(HIST_EMIN, HIST_EMIN + HIST_BINS), counts.copy()

