"""The statistics row: one fixed float64 vector per (module, tensor role).

float64 keeps counts exact up to 2**53 elements (a float32 count stops at 2**24) and keeps the
sums accurate; every field is mergeable (sum, min or max), so rows from micro-batches, kernel
programs and ranks combine in any order.
"""
from __future__ import annotations

import enum
import math

import numpy as np
import torch

from ..formats import ROW_FORMATS

# Exponent histogram: bin b counts finite nonzero |x| with floor(log2|x|) == HIST_EMIN + b; the
# first bin also takes everything smaller and the last everything larger.
HIST_BINS = 128
HIST_EMIN = -96
HIST_EMAX = HIST_EMIN + HIST_BINS - 1  # 31


class Merge(enum.Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class Stat(enum.IntEnum):
    NUMEL = 0
    NAN = 1
    POSINF = 2
    NEGINF = 3
    ZEROS = 4
    MIN = 5           # over finite values
    MAX = 6
    ABSMAX = 7
    ABSMIN_NZ = 8     # smallest nonzero finite |x|
    SUM = 9
    SUMSQ = 10
    E4M3_OVERFLOW = 11
    E4M3_UNDERFLOW = 12
    E4M3_SUBNORMAL = 13
    E5M2_OVERFLOW = 14
    E5M2_UNDERFLOW = 15
    E5M2_SUBNORMAL = 16
    FP16_OVERFLOW = 17
    FP16_UNDERFLOW = 18
    FP16_SUBNORMAL = 19
    BITS_LO = 20      # fingerprint: sum of the low 16 bits of each value's float32 bit pattern
    BITS_HI = 21      # ... and of the high 16 bits (exact integers: equal tensors, equal sums)
    HIST = 22         # first of HIST_BINS histogram fields


N_SCALAR = int(Stat.HIST)
N_STATS = N_SCALAR + HIST_BINS
ROW_DTYPE = torch.float64

# For the format counts: FMT_BASE[fmt] + 0 overflow, + 1 underflow, + 2 subnormal.
FMT_BASE = {f: int(Stat.E4M3_OVERFLOW) + 3 * i for i, f in enumerate(ROW_FORMATS)}

MERGE_OF: list[Merge] = [Merge.SUM] * N_STATS
MERGE_OF[Stat.MIN] = Merge.MIN
MERGE_OF[Stat.ABSMIN_NZ] = Merge.MIN
MERGE_OF[Stat.MAX] = Merge.MAX
MERGE_OF[Stat.ABSMAX] = Merge.MAX

_INIT = np.zeros(N_STATS, dtype=np.float64)
_INIT[Stat.MIN] = math.inf
_INIT[Stat.ABSMIN_NZ] = math.inf
_INIT[Stat.MAX] = -math.inf
_INIT[Stat.ABSMAX] = -math.inf  # stays -inf when there is no finite value at all


def init_row() -> np.ndarray:
    """The identity row for merging (an empty tensor's row)."""
    return _INIT.copy()


def init_row_tensor(device: "torch.device | str" = "cpu", rows: "int | None" = None) -> torch.Tensor:
    """Identity row(s) made on the device itself (fills, no host-to-device copy)."""
    shape = (N_STATS,) if rows is None else (rows, N_STATS)
    r = torch.zeros(shape, dtype=ROW_DTYPE, device=device)
    r[..., Stat.MIN] = math.inf
    r[..., Stat.ABSMIN_NZ] = math.inf
    r[..., Stat.MAX] = -math.inf
    r[..., Stat.ABSMAX] = -math.inf
    return r


_MIN_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.MIN]
_MAX_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.MAX]
_SUM_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.SUM]


def merge_rows(rows: np.ndarray) -> np.ndarray:
    """Merge rows stacked along axis 0 (numpy, host side: ranks, shards, micro-batches)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, N_STATS)
    out = init_row()
    if rows.shape[0] == 0:
        return out
    out[_SUM_IDX] = rows[:, _SUM_IDX].sum(axis=0)
    out[_MIN_IDX] = rows[:, _MIN_IDX].min(axis=0)
    out[_MAX_IDX] = rows[:, _MAX_IDX].max(axis=0)
    return out


def merge_into(dst: torch.Tensor, row: torch.Tensor) -> None:
    """dst <- merge(dst, row) for device rows, in place, with views only (no host sync)."""
    dst[: Stat.MIN].add_(row[: Stat.MIN])
    dst[Stat.SUM:].add_(row[Stat.SUM:])
    for i in (Stat.MIN, Stat.ABSMIN_NZ):
        torch.minimum(dst[i], row[i], out=dst[i])
    for i in (Stat.MAX, Stat.ABSMAX):
        torch.maximum(dst[i], row[i], out=dst[i])
