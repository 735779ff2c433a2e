"""One helper to compare two statistics rows, with NaN/Inf-aware messages naming each field."""
from __future__ import annotations

import math

import numpy as np
import torch

from stabilitywatch.stats.layout import HIST_BINS, HIST_EMIN, N_STATS, Stat

_SUM_FIELDS = (int(Stat.SUM), int(Stat.SUMSQ), int(Stat.SHIFT_SUM), int(Stat.SHIFT_SUMSQ))


def as_numpy_row(row) -> np.ndarray:
    """A float64 numpy copy of a row given as a torch tensor (any device) or array-like."""
    if isinstance(row, torch.Tensor):
        row = row.detach().to("cpu", torch.float64).numpy()
    out = np.array(row, dtype=np.float64).reshape(-1)
    if out.shape != (N_STATS,):
        raise AssertionError(f"a statistics row has {N_STATS} values, got shape {out.shape}")
    return out


def field_name(i: int) -> str:
    """Stat name of row index i; histogram bins as HIST[b] (2^e)."""
    if i < int(Stat.HIST):
        return Stat(i).name
    b = i - int(Stat.HIST)
    e = HIST_EMIN + b
    edge = "<=" if b == 0 else ">=" if b == HIST_BINS - 1 else ""
    return f"HIST[{b}] (2^{edge}{e})"


def _same(a: float, b: float) -> bool:
    # +-inf equal only to itself, NaN equal to NaN
    return a == b or (math.isnan(a) and math.isnan(b))


def _fmt(v: float) -> str:
    return repr(float(v))


def assert_rows_match(got, want, *, sum_rtol: float = 1e-12, abs_sum: "float | None" = None,
                      merged: bool = False, label: str = "") -> None:
    """Assert two statistics rows agree.

    Counts, histogram and MIN/MAX/ABSMAX/ABSMIN_NZ must be identical (NaN matches NaN, +-inf
    matches itself). SUM must be within sum_rtol * scale, where scale is `abs_sum` (the sum of
    |x| over finite values) when given, else sqrt(finite count * SUMSQ) (an upper bound of sum
    |x|); SUMSQ within sum_rtol * SUMSQ (a sum of non-negative terms). SHIFT exactly;
    SHIFT_SUM within sum_rtol * (that scale + n |K|) (the kernels take it as SUM - n K);
    SHIFT_SUMSQ within sum_rtol * SHIFT_SUMSQ, plus, for `merged` rows (tensors merged into a
    row holding another shift: their sums are re-expressed at it), 2 D (scale + n |K|) + n D^2
    for the spread D = max - min (no shift lies farther from another). A zero scale demands
    equality. The message lists every differing field with both values.
    """
    g, w = as_numpy_row(got), as_numpy_row(want)
    problems = []
    for i in range(N_STATS):
        if i in _SUM_FIELDS:
            continue
        if not _same(g[i], w[i]):
            problems.append(f"{field_name(i)}: got {_fmt(g[i])}, want {_fmt(w[i])}")

    finite_n = w[Stat.NUMEL] - w[Stat.NAN] - w[Stat.POSINF] - w[Stat.NEGINF]
    sumsq = abs(w[Stat.SUMSQ])
    s1 = abs_sum if abs_sum is not None else math.sqrt(max(finite_n, 0.0) * sumsq)
    k = abs(w[Stat.SHIFT])
    spread = w[Stat.MAX] - w[Stat.MIN] if finite_n > 0 else 0.0
    spread = spread if math.isfinite(spread) else 0.0
    ssq = abs(w[Stat.SHIFT_SUMSQ])
    if merged:
        ssq += 2 * spread * (s1 + finite_n * k) + finite_n * spread * spread
    scales = {int(Stat.SUM): s1, int(Stat.SUMSQ): sumsq,
              int(Stat.SHIFT_SUM): s1 + max(finite_n, 0.0) * k, int(Stat.SHIFT_SUMSQ): ssq}
    for i in _SUM_FIELDS:
        a, b = g[i], w[i]
        if _same(a, b):
            continue
        if not (math.isfinite(a) and math.isfinite(b)):
            problems.append(f"{field_name(i)}: got {_fmt(a)}, want {_fmt(b)}")
            continue
        tol = sum_rtol * scales[i]
        if not abs(a - b) <= tol:
            problems.append(f"{field_name(i)}: got {_fmt(a)}, want {_fmt(b)} "
                            f"(|diff| {abs(a - b):.3g} > tol {tol:.3g})")
    if problems:
        head = f"rows differ{' [' + label + ']' if label else ''} in {len(problems)} field(s):"
        raise AssertionError("\n  ".join([head, *problems]))
