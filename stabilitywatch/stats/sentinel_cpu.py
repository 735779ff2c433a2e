"""The gradient sentinel of CPU gradients, read in numpy: per gradient its minimum and maximum
(two read-only passes, which also tell whether any value is NaN or Inf: both propagate) and its
sum of squares in float64; the exact non-finite and NaN counts take their own passes only for a
gradient that holds such a value. Same numbers as the pure-torch twin (stats/sentinel.py),
which makes a dozen whole-batch ops, each with a fresh temporary of every gradient's size.

CPU memory is host memory: reading it here waits for no device.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .cpu import host_view
from .cpu_sums import DOT
from .sentinel import C_ABSMAX, C_NAN, C_NONFINITE, C_SUMSQ

_DIRECT = (torch.float32, torch.float64)

_local = threading.local()


def _buf(dtype) -> np.ndarray:
    have = getattr(_local, "bufs", None)
    if have is None:
        have = _local.bufs = {}
    b = have.get(dtype)
    if b is None:
        b = have[dtype] = np.empty(DOT, dtype=dtype)
    return b


def host_ok(g: torch.Tensor) -> bool:
    """True when sentinel_host reads g: a plain strided CPU tensor of a floating dtype."""
    return (type(g) is torch.Tensor and g.device.type == "cpu" and g.layout == torch.strided
            and g.is_floating_point())


def sentinel_host(grads: list, out: torch.Tensor, slots: list) -> None:
    """sentinel_reference(grads, out, slots) for CPU gradients (host_ok) and a CPU `out`."""
    o = host_view(out)
    with np.errstate(all="ignore"):   # NaN and Inf are data here
        rest = _together(grads, slots, o)
        for g, s in rest:
            bad, amax, sq, nan = _one(g)
            o[s, C_NONFINITE] += bad
            o[s, C_ABSMAX] = max(o[s, C_ABSMAX], amax)
            o[s, C_SUMSQ] += sq
            o[s, C_NAN] += nan


# gradients read together up to this many values (a float32 and a float64 copy of them)
TOGETHER = 1 << 18
# larger gradients are read on their own, in place: their calls cost little next to their
# values, which a copy would read twice
ALONE = 1 << 14


def _together(grads: list, slots: list, o: np.ndarray) -> list:
    """The small contiguous float32 gradients of distinct rows, read together in groups of up
    to TOGETHER values: one copy per group, then each statistic over all of them (per gradient by
    segment sums), where ~6 numpy calls per gradient cost more than reading its values.
    Returns the (gradient, row) pairs left for _one: other dtypes, layouts and larger
    gradients, and those holding a NaN or an Inf (their counts take passes of their own)."""
    rest: list = []
    group: list = []
    used = 0
    seen: set = set()
    for g, s in zip(grads, slots):
        n = g.numel()
        if not n:
            continue
        if (g.dtype == torch.float32 and n <= ALONE and g.is_contiguous() and not g.is_neg()
                and s not in seen):
            seen.add(s)
            if used + n > TOGETHER:
                rest += _group(group, used, o)
                group, used = [], 0
            group.append((g, s))
            used += n
        else:
            rest.append((g, s))
    return rest + _group(group, used, o)


def _group(keep: list, total: int, o: np.ndarray) -> list:
    if len(keep) < 2:
        return keep
    sizes = [g.numel() for g, _ in keep]
    x32, x64 = _wide(total)
    torch.cat([g.detach().reshape(-1) for g, _ in keep], out=torch.from_numpy(x32))
    starts = np.zeros(len(keep), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    lo, hi = np.minimum.reduceat(x32, starts), np.maximum.reduceat(x32, starts)
    np.copyto(x64, x32)
    np.multiply(x64, x64, out=x64)
    sq = np.add.reduceat(x64, starts)
    # NaN and Inf propagate into both extrema: such a gradient is read again on its own
    clean = np.isfinite(lo) & np.isfinite(hi)
    amax = np.maximum(-lo.astype(np.float64), hi)
    rows = np.array([s for _, s in keep], dtype=np.int64)[clean]   # distinct rows
    o[rows, C_ABSMAX] = np.maximum(o[rows, C_ABSMAX], amax[clean])
    o[rows, C_SUMSQ] += sq[clean]
    if clean.all():
        return []
    return [keep[k] for k in np.flatnonzero(~clean).tolist()]   # sync-ok: numpy


def _wide(n: int) -> tuple:
    # a float32 and a float64 array of n values, kept per thread (grown when needed)
    have = getattr(_local, "wide", None)
    if have is None or have[0].size < n:
        have = _local.wide = (np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float64))
    return have[0][:n], have[1][:n]


def _values(g: torch.Tensor):
    """Chunks of g's values as float32/float64 numpy arrays: views of g's memory when it is
    one contiguous float32/float64 tensor, else copies through a kept buffer (DOT values)."""
    t = g.detach().resolve_neg()
    if t.dtype in _DIRECT and t.is_contiguous():
        yield host_view(t.reshape(-1))
        return
    flat = t.reshape(-1)                    # a copy only for tensors with gaps
    work = np.float64 if t.dtype == torch.float64 else np.float32
    buf = _buf(work)
    for i in range(0, flat.numel(), DOT):
        part = flat[i: i + DOT]
        b = buf[: part.numel()]
        torch.from_numpy(b).copy_(part)
        yield b


def _one(g: torch.Tensor) -> tuple:
    """(non-finite count, largest finite |x|, sum of squares of the finite values, NaN count)."""
    bad = nan = 0
    amax, sq = 0.0, 0.0
    d = _buf(np.float64)
    for x in _values(g):
        lo, hi = float(np.minimum.reduce(x)), float(np.maximum.reduce(x))
        if not (abs(lo) < np.inf and abs(hi) < np.inf):    # NaN or Inf in this chunk
            fin = np.isfinite(x)
            nf = int(np.count_nonzero(fin))
            bad += x.size - nf
            nan += int(np.count_nonzero(np.isnan(x)))
            x = x[fin]                                    # host memory: no device to wait for
            if not nf:
                continue
            lo, hi = float(np.minimum.reduce(x)), float(np.maximum.reduce(x))
        amax = max(amax, -lo, hi)
        for i in range(0, x.size, DOT):
            part = x[i: i + DOT]
            b = part if part.dtype == np.float64 else d[: part.size]
            if b is not part:
                np.copyto(b, part)
            sq += float(np.dot(b, b))
    return bad, amax, sq, nan
