"""Divergence: data-parallel replicas that should hold identical tensors, and don't.

Under DDP every rank holds the same parameters, the same gradients after the all-reduce and
the same optimizer state. Each rank's row of such a tensor carries a fingerprint (the exact
integer sums of the low and high 16 bits of every value's bit pattern, plus numel, counts,
min, max and sums); the distributed flush brings every rank's fingerprint to the frame
(`DistFrame.replicas`, see stabilitywatch/distributed). Ranks are grouped by equal
fingerprints; the ranks outside the largest group (ties: the group holding the lowest rank,
so with two replicas rank 0 is the reference) are named in one critical alert per tensor.
Activations (different data on each rank) and sharded tensors (FSDP) are not compared.

The bit sums and counts must match exactly; float sums only within a relative 1e-9 (the GPU
kernel adds float64 partial sums with atomics, so identical tensors may differ in the last bits).
"""
from __future__ import annotations

import math

import numpy as np

from ..alert import Alert, Severity
from ..stats.buffer import StatsFrame
from ..stats.layout import FP_STATS, Stat
from .base import Detector

_NAMES = [s.name.lower() for s in FP_STATS]
_I = {s: i for i, s in enumerate(FP_STATS)}
_TOLERANT = {_I[Stat.SUM], _I[Stat.SUMSQ]}
SUM_RTOL = 1e-9


def differing(a: np.ndarray, b: np.ndarray) -> list[str]:
    """Names of the fingerprint fields where two replicas' rows differ (exact fields first)."""
    out = []
    n = max(a[_I[Stat.NUMEL]], b[_I[Stat.NUMEL]], 1.0)
    for i, name in enumerate(_NAMES):
        x, y = float(a[i]), float(b[i])
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        if i in _TOLERANT:
            scale = (math.sqrt(n * max(a[_I[Stat.SUMSQ]], b[_I[Stat.SUMSQ]], 0.0))
                     if i == _I[Stat.SUM] else max(abs(x), abs(y)))
            if abs(x - y) <= SUM_RTOL * scale:
                continue
        out.append(name)
    return out


def _num(v: float):
    v = float(v)
    return v if math.isfinite(v) else str(v)


class DivergenceDetector(Detector):
    name = "divergence"

    def check(self, frame: StatsFrame) -> list[Alert]:
        replicas = getattr(frame, "replicas", None)
        if not replicas:
            return []
        out: list[Alert] = []
        for i in sorted(replicas):
            reps = replicas[i]
            if len(reps) < 2:
                continue
            groups: list[list[int]] = []
            for r in sorted(reps):
                for g in groups:
                    if not differing(reps[g[0]], reps[r]):
                        g.append(r)
                        break
                else:
                    groups.append([r])
            if len(groups) == 1:
                continue
            # merged by reduction: each replica stands for the ranks at one extreme
            info = getattr(frame, "replica_info", {}).get(i, {})

            def size(g, info=info):
                return sum(info[r][0] if r in info else 1 for r in g)
            major = max(groups, key=lambda g: (size(g), -g[0]))
            outliers = sorted(r for g in groups if g is not major for r in g)
            # per-rank files: rank 0 and the ranks that differ report it, not every rank
            if not getattr(frame, "merged", False) and frame.rank != 0 \
                    and frame.rank not in outliers:
                continue
            out.append(self._alert(frame, i, reps, major, outliers, info))
        return out

    def _alert(self, frame, i, reps, major, outliers, info=None) -> Alert:
        module, role = frame.keys[i]
        ref, bad = major[0], outliers[0]
        fields = differing(reps[ref], reps[bad])
        stat = fields[0]
        k = _NAMES.index(stat)
        delta = float(reps[bad][k]) - float(reps[ref][k])
        info = info or {}
        n = info.get("present", len(reps))
        agree = sum(info[r][0] if r in info else 1 for r in major)
        who = f"rank {bad}" if len(outliers) == 1 else f"ranks {', '.join(map(str, outliers))}"
        if bad in info and info[bad][0] > 1:
            lo, hi = info[bad][1], info[bad][2]
            who = f"ranks {lo}..{hi} ({info[bad][0]} ranks)"
        basis = (f"{agree} of {n} replicas agree" if agree > 1 else
                 f"{n} replicas, no majority: rank {ref} is the reference")
        detail = ", ".join(f"{f} {_fmt(reps[ref][_NAMES.index(f)])} vs "
                           f"{_fmt(reps[bad][_NAMES.index(f)])}" for f in fields)
        msg = (f"{who} of {frame.world_size} hold(s) a different {role} of {module or '<model>'} "
               f"than rank {ref} ({basis}): {detail}. Replicated tensors (parameters, gradients "
               f"after the all-reduce, optimizer state) must match bit for bit: silent data "
               f"corruption or an update that was not synchronised on {who}")
        extra = {"ranks": outliers, "reference_ranks": major,
                 **({"rank_ranges": {str(r): list(info[r][1:]) for r in outliers + major
                                     if r in info}} if info else {}),
                 "fields": {f: [_num(reps[ref][_NAMES.index(f)]),
                                _num(reps[bad][_NAMES.index(f)])] for f in fields}}
        return Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                     module=module, tensor=role, stat=stat, value=delta, threshold=0.0,
                     message=msg, rank=bad, extra=extra)


def _fmt(v) -> str:
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 2**53:
        return str(int(v))
    return f"{v:.17g}"
