"""Merges of host statistics rows (numpy), the CPU path's counterpart of layout.merge_into."""
from __future__ import annotations

import numpy as np

from .layout import Stat


def merge_host(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[i] <- merge(dst[i], src[i]) for host rows stacked along axis 0, in place: the same
    merge as layout.merge_into (dst keeps its shift when it has one, else takes src's)."""
    kd, ks = dst[:, Stat.SHIFT], src[:, Stat.SHIFT]
    if not dst[:, Stat.NUMEL].any() and np.all((kd == 0) & np.signbit(kd)):
        dst[:] = src    # identity rows (the usual case: a row's first tensor of the step)
        return
    k = np.where((kd == 0) & np.signbit(kd), ks, kd)
    with np.errstate(all="ignore"):
        d = np.where((ks == 0) & np.signbit(ks), 0.0, ks - k)
        d = np.where(np.isfinite(d), d, 0.0)
        n = src[:, Stat.NUMEL] - src[:, Stat.NAN] - src[:, Stat.POSINF] - src[:, Stat.NEGINF]
        s1, s2 = src[:, Stat.SHIFT_SUM], src[:, Stat.SHIFT_SUMSQ]
        dst[:, Stat.SHIFT_SUMSQ] += s2 + 2.0 * d * s1 + n * d * d
        dst[:, Stat.SHIFT_SUM] += s1 + n * d
    dst[:, Stat.SHIFT] = k
    dst[:, : Stat.MIN] += src[:, : Stat.MIN]
    dst[:, Stat.SUM: Stat.SHIFT] += src[:, Stat.SUM: Stat.SHIFT]
    dst[:, Stat.HIST:] += src[:, Stat.HIST:]
    for i in (Stat.MIN, Stat.ABSMIN_NZ):
        np.minimum(dst[:, i], src[:, i], out=dst[:, i])
    for i in (Stat.MAX, Stat.ABSMAX):
        np.maximum(dst[:, i], src[:, i], out=dst[:, i])


def merge_at(dst: np.ndarray, slots: np.ndarray, src: np.ndarray) -> None:
    """dst[slots[i]] <- merge(dst[slots[i]], src[i]) in order: a slot that comes twice takes
    its second row in a second round."""
    # each slot once: one round
    if slots.size <= 64 and len(set(slots.tolist())) == slots.size:   # sync-ok: numpy
        part = dst[slots]
        merge_host(part, src)
        dst[slots] = part
        return
    while slots.size:
        _, first = np.unique(slots, return_index=True)
        part = dst[slots[first]]
        merge_host(part, src[first])
        dst[slots[first]] = part
        rest = np.ones(slots.size, dtype=bool)
        rest[first] = False
        slots, src = slots[rest], src[rest]
