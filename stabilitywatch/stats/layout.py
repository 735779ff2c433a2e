"""The statistics row: one fixed float64 vector per (module, tensor role).

float64 keeps counts exact up to 2**53 elements (a float32 count stops at 2**24) and keeps the
sums accurate; every field is mergeable (sum, min or max, and the shifted sums below), so rows
from micro-batches, kernel programs and ranks combine in any order.

Shifted sums keep the standard deviation when the mean is large against it (std from SUM and
SUMSQ alone cancels: 1e8 + 0.01 * randn gives 1.4 instead of 0.01): SHIFT_SUM and SHIFT_SUMSQ
are the sums of (x - K) and (x - K)^2 over finite values, for the row's shift K (SHIFT). K is
the first element of the first tensor merged into the row (0 when that is not finite); every
kernel program loads it, claims it for the row with one compare-and-swap (the row's K wins when
it is already set) and re-expresses its own sums at the row's K. Two rows with shifts K1, K
merge at K: S1 + n1 (K1 - K), S2 + 2 (K1 - K) S1 + n1 (K1 - K)^2 (n1: finite values of the
first). A row nothing was merged into holds -0.0 in SHIFT (unset; it reads as the shift 0 and
its shifted sums are 0, so it merges as the identity either way). SUM and SUMSQ stay plain sums:
l2norm = sqrt(SUMSQ) exactly, as the fingerprint and the mean.
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
    SHIFT = "shift"   # the shift and the two shifted sums: merge_rows / merge_into


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
    SHIFT = 22        # K, the row's shift (-0.0: unset)
    SHIFT_SUM = 23    # sum of (x - K) over finite values
    SHIFT_SUMSQ = 24  # sum of (x - K)^2 over finite values
    HIST = 25         # first of HIST_BINS histogram fields


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
for _i in (Stat.SHIFT, Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ):
    MERGE_OF[_i] = Merge.SHIFT
UNSET_SHIFT = -0.0

_INIT = np.zeros(N_STATS, dtype=np.float64)
_INIT[Stat.MIN] = math.inf
_INIT[Stat.ABSMIN_NZ] = math.inf
_INIT[Stat.MAX] = -math.inf
_INIT[Stat.ABSMAX] = -math.inf  # stays -inf when there is no finite value at all
_INIT[Stat.SHIFT] = UNSET_SHIFT


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
    r[..., Stat.SHIFT] = UNSET_SHIFT
    return r


_MIN_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.MIN]
_MAX_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.MAX]
_SUM_IDX = [i for i, m in enumerate(MERGE_OF) if m is Merge.SUM]
_SHIFTED = [int(Stat.SHIFT_SUM), int(Stat.SHIFT_SUMSQ)]


def shift_is_set(k: np.ndarray) -> np.ndarray:
    """True where a row's SHIFT holds a shift (anything but -0.0)."""
    k = np.asarray(k, dtype=np.float64)
    return ~((k == 0) & np.signbit(k))


def finite_counts(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, N_STATS)
    return rows[:, Stat.NUMEL] - rows[:, Stat.NAN] - rows[:, Stat.POSINF] - rows[:, Stat.NEGINF]


def common_shift(k: np.ndarray) -> float:
    """The shift rows merge at: the first of their set shifts (as on the device, where the first
    tensor merged into a row sets it), unset when none is set. The derived values do not depend
    on which shift is taken, only the shifted sums' representation does."""
    k = np.asarray(k, dtype=np.float64).reshape(-1)
    k = k[shift_is_set(k)]
    return float(k[0]) if k.size else UNSET_SHIFT


def reshift(rows: np.ndarray, k) -> np.ndarray:
    """A copy of rows (stacked along axis 0) with their shifted sums at the shift k (one value,
    or one per row): S1 + n (K1 - k), S2 + 2 (K1 - k) S1 + n (K1 - k)^2."""
    out = np.array(rows, dtype=np.float64).reshape(-1, N_STATS)
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), (out.shape[0],))
    k1 = out[:, Stat.SHIFT]
    d = np.where(shift_is_set(k1) & shift_is_set(k), k1 - np.where(shift_is_set(k), k, 0.0), 0.0)
    d = np.where(np.isfinite(d), d, 0.0)
    n = finite_counts(out)
    s1 = out[:, Stat.SHIFT_SUM].copy()
    out[:, Stat.SHIFT_SUM] = s1 + n * d
    out[:, Stat.SHIFT_SUMSQ] = out[:, Stat.SHIFT_SUMSQ] + 2.0 * d * s1 + n * d * d
    out[:, Stat.SHIFT] = k
    return out


def merge_rows(rows: np.ndarray) -> np.ndarray:
    """Merge rows stacked along axis 0 (numpy, host side: ranks, shards, micro-batches)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, N_STATS)
    out = init_row()
    if rows.shape[0] == 0:
        return out
    k = common_shift(rows[:, Stat.SHIFT])
    rows = reshift(rows, k)
    out[_SUM_IDX] = rows[:, _SUM_IDX].sum(axis=0)
    out[_MIN_IDX] = rows[:, _MIN_IDX].min(axis=0)
    out[_MAX_IDX] = rows[:, _MAX_IDX].max(axis=0)
    out[_SHIFTED] = rows[:, _SHIFTED].sum(axis=0)
    out[Stat.SHIFT] = k
    return out


def merge_into(dst: torch.Tensor, row: torch.Tensor) -> None:
    """dst <- merge(dst, row) for device rows, in place, with views only (no host sync). The
    merged row keeps dst's shift when it has one (as the kernels do), else takes row's."""
    kd, kr = dst[Stat.SHIFT], row[Stat.SHIFT]
    unset_d = (kd == 0) & torch.signbit(kd)
    k = torch.where(unset_d, kr, kd)
    d = torch.where((kr == 0) & torch.signbit(kr), 0.0, kr - k)
    d = torch.where(d.isfinite(), d, 0.0)
    n = row[Stat.NUMEL] - row[Stat.NAN] - row[Stat.POSINF] - row[Stat.NEGINF]
    s1, s2 = row[Stat.SHIFT_SUM], row[Stat.SHIFT_SUMSQ]
    dst[Stat.SHIFT_SUMSQ].add_(s2 + 2.0 * d * s1 + n * d * d)
    dst[Stat.SHIFT_SUM].add_(s1 + n * d)
    dst[Stat.SHIFT].copy_(k)
    dst[: Stat.MIN].add_(row[: Stat.MIN])
    dst[Stat.SUM: Stat.SHIFT].add_(row[Stat.SUM: Stat.SHIFT])
    dst[Stat.HIST:].add_(row[Stat.HIST:])
    for i in (Stat.MIN, Stat.ABSMIN_NZ):
        torch.minimum(dst[i], row[i], out=dst[i])
    for i in (Stat.MAX, Stat.ABSMAX):
        torch.maximum(dst[i], row[i], out=dst[i])


# what a fingerprint of a replicated tensor holds: enough to tell replicas apart (the bit sums
# are exact); the divergence detector compares them and the cross-rank merge reduces them
FP_STATS = (Stat.NUMEL, Stat.NAN, Stat.POSINF, Stat.NEGINF, Stat.ZEROS, Stat.MIN, Stat.MAX,
            Stat.ABSMAX, Stat.ABSMIN_NZ, Stat.BITS_HI, Stat.BITS_LO, Stat.SUM, Stat.SUMSQ)
