"""Host-side values derived from a statistics row (numpy)."""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..formats import FORMATS, ROW_FORMATS
from .layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, Stat, shift_is_set
from .scale import effective_scales

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
    """derive() for every row of a frame at once: the arithmetic runs on columns (numpy), only
    the final dicts are built per row (this runs in the training thread for every frame)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, N_STATS)
    scale = effective_scales(scales).reshape(-1)
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
    table = {k: c.tolist() for k, c in cols.items()}  # sync-ok: host numpy arrays
    hists = rows[:, Stat.HIST: Stat.HIST + HIST_BINS]  # a view: the frame's rows are its own
    hists.flags.writeable = False
    return [DerivedRow(table, i, hists) for i in range(rows.shape[0])]


class DerivedRow(Mapping):
    """One row's named values, read from the frame's shared columns: building a dict per row was
    most of the frame's host time; sinks iterate it later, on their own thread."""

    __slots__ = ("_cols", "_i", "_hists")

    def __init__(self, cols: dict, i: int, hists: "np.ndarray | None" = None):
        self._cols, self._i, self._hists = cols, i, hists

    def __getitem__(self, key: str) -> float:
        return self._cols[key][self._i]

    def __iter__(self):
        return iter(self._cols)

    def __len__(self) -> int:
        return len(self._cols)

    def column(self, key: str) -> list:
        """This value for every row of the frame (the shared column)."""
        return self._cols[key]

    @property
    def table(self) -> dict:
        """The frame's shared columns (name -> list of values, one per row)."""
        return self._cols

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

