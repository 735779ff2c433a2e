"""Host-side values derived from a statistics row (numpy), and `tensor_stats`."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..formats import FORMATS, ROW_FORMATS
from .layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, Stat

COUNT_KEYS = {"numel": Stat.NUMEL, "nan": Stat.NAN, "posinf": Stat.POSINF,
              "neginf": Stat.NEGINF, "zeros": Stat.ZEROS}


def finite_count(row: np.ndarray) -> float:
    return float(row[Stat.NUMEL] - row[Stat.NAN] - row[Stat.POSINF] - row[Stat.NEGINF])


def derive(row: np.ndarray, scale: float = 1.0) -> dict[str, float]:
    """Named values of one row. Value statistics cover finite values only and are NaN when there
    are none; std is the population standard deviation (ddof=0)."""
    row = np.asarray(row, dtype=np.float64)
    out = {k: float(row[i]) for k, i in COUNT_KEYS.items()}
    n = finite_count(row)
    nan = math.nan
    has = n > 0
    out["finite"] = n
    out["min"] = float(row[Stat.MIN]) if has else nan
    out["max"] = float(row[Stat.MAX]) if has else nan
    absmax = float(row[Stat.ABSMAX]) if has else nan
    out["absmax"] = absmax
    nz = float(row[Stat.ABSMIN_NZ])
    out["absmin_nonzero"] = nz if math.isfinite(nz) else nan
    out["sum"] = float(row[Stat.SUM])
    mean = float(row[Stat.SUM]) / n if has else nan
    out["mean"] = mean
    ms = float(row[Stat.SUMSQ]) / n if has else nan
    out["std"] = math.sqrt(max(ms - mean * mean, 0.0)) if has else nan
    out["rms"] = math.sqrt(ms) if has else nan
    out["l2norm"] = math.sqrt(float(row[Stat.SUMSQ]))
    nonzero = n - float(row[Stat.ZEROS])
    for fmt in ROW_FORMATS:
        base, name = FMT_BASE[fmt], fmt.value
        over, under, sub = (float(row[base + k]) for k in range(3))
        out[f"{name}_overflow"] = over
        out[f"{name}_underflow"] = under
        out[f"{name}_subnormal"] = sub
        out[f"{name}_overflow_frac"] = over / n if has else 0.0
        out[f"{name}_underflow_frac"] = under / nonzero if nonzero > 0 else 0.0
        amax_s = absmax * scale
        out[f"{name}_headroom_bits"] = (math.log2(FORMATS[fmt].max) - math.log2(amax_s)
                                        if has and amax_s > 0 else nan)
    if has and absmax > 0 and math.isfinite(nz):
        out["dynamic_range_bits"] = math.log2(absmax) - math.log2(nz)
    else:
        out["dynamic_range_bits"] = nan
    return out


def histogram(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, counts): counts[i] values with floor(log2|x|) == exponents[i] (end bins open)."""
    counts = np.asarray(row, dtype=np.float64)[Stat.HIST: Stat.HIST + HIST_BINS]
    return np.arange(HIST_EMIN, HIST_EMIN + HIST_BINS), counts.copy()


def tensor_stats(t: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    """One-off statistics of a tensor, synchronous. The same numbers the hooks log: the Triton
    kernel on CUDA when it is available, the pure-torch reference otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_stats expects a torch.Tensor, got {type(t).__name__}")
    from ..kernels.dispatch import compute_row  # late: kernels may pull in triton

    row = compute_row(t, scale)
    assert row.shape == (N_STATS,)
    return derive(row.cpu().numpy(), float(scale))  # sync-ok: tensor_stats is synchronous
