"""Host-side shadow error measures, from the statistics rows the replicas recorded.

For a live output y and its shadow s (both as rows: y's `output` or `shadow.live` row, s's
`shadow.output` row, e = y - s's `shadow.error` row and the `shadow.ulp` row), in float64:
  rel_l2  = ||e|| / ||s||                     sqnr_db = 10 log10(||s||^2 / ||e||^2)
  cosine  = (||y||^2 + ||s||^2 - ||e||^2) / (2 ||y|| ||s||)   (polarisation identity: y.s)
  max_abs = max |e|      max_ulp = max |e| / ulp_live(s)      mean_ulp = mean of the same
Rows merge across repeated calls of a module within a step, and so do these measures.
"""
from __future__ import annotations

import math
from typing import Optional

from ..stats.buffer import StatsFrame
from ..stats.layout import Stat

KINDS = ("shadow.model", "shadow")   # longest prefix first


def _split(role: str):
    """('shadow', '.0') for 'shadow.error.0'; None for rows that are not error rows."""
    for kind in KINDS:
        head = f"{kind}.error"
        if role.startswith(head) and (len(role) == len(head) or role[len(head)] == "."):
            return kind, role[len(head):]
    return None


def is_shadow_role(role: str) -> bool:
    return role.startswith("shadow.")


def shadow_plan(keys) -> list[tuple]:
    """[(module, kind, suffix, error row, shadow row, ulp row, live row)] of a row set, for the
    error rows with a shadow row (rows absent: None)."""
    where: dict = {}
    for i, k in enumerate(keys):
        where.setdefault(k, i)   # the first row of a key, as frame.index gives it
    row = lambda m, r: where.get((m, r))  # noqa: E731
    out = []
    for i, (module, role) in enumerate(keys):
        if not role.startswith("shadow"):  # most rows; checked at C speed before _split
            continue
        split = _split(role)
        if split is None:
            continue
        kind, sfx = split
        s = row(module, f"{kind}.output{sfx}")
        if s is None:
            continue
        y = row(module, f"output{sfx}")
        if y is None:
            y = row(module, f"shadow.live{sfx}")
        out.append((module, kind, sfx, i, s, row(module, f"{kind}.ulp{sfx}"), y))
    return out


def shadow_metrics(frame: StatsFrame, plan: Optional[list] = None
                   ) -> list[tuple[str, str, str, dict[str, float]]]:
    """[(module, kind, output suffix, measures)] for every shadow error row of the frame (worked
    out once per frame: the detector and the records both read them)."""
    return frame.memo("shadow_metrics", lambda f: _metrics(
        f, shadow_plan(f.keys) if plan is None else plan))


def _metrics(frame: StatsFrame, plan: list) -> list:
    out = []
    rows = frame.rows
    for module, kind, sfx, ie, is_, iu, iy in plan:
        e, s = rows[ie], rows[is_]
        u = None if iu is None else rows[iu]
        y = None if iy is None else rows[iy]
        e2, s2 = float(e[Stat.SUMSQ]), float(s[Stat.SUMSQ])
        m = {"rel_l2": math.sqrt(e2 / s2) if s2 > 0 else (0.0 if e2 == 0 else math.inf),
             # a difference of logs: the ratio itself can under- or overflow float64
             "sqnr_db": 10 * (math.log10(s2) - math.log10(e2)) if e2 > 0 and s2 > 0 else
             (math.inf if e2 == 0 else -math.inf),
             "max_abs_err": float(e[Stat.ABSMAX]) if e[Stat.NUMEL] > 0 else math.nan}
        if y is not None and y[Stat.SUMSQ] > 0 and s2 > 0:
            y2 = float(y[Stat.SUMSQ])
            m["cosine"] = max(-1.0, min(1.0, (y2 + s2 - e2) / (2 * math.sqrt(y2) * math.sqrt(s2))))
        else:
            m["cosine"] = math.nan
        if u is not None:
            finite = float(u[Stat.NUMEL] - u[Stat.NAN] - u[Stat.POSINF] - u[Stat.NEGINF])
            m["max_ulp"] = float(u[Stat.ABSMAX]) if finite > 0 else math.nan
            m["mean_ulp"] = float(u[Stat.SUM]) / finite if finite > 0 else math.nan
        if e[Stat.NAN] + e[Stat.POSINF] + e[Stat.NEGINF] > 0:
            # NaN/Inf in live - shadow: the finite-only sums above would understate it
            m["rel_l2"], m["sqnr_db"] = math.inf, -math.inf
        out.append((module, kind, sfx, m))
    return out


def shadow_records(frame: StatsFrame, base: dict, plan: Optional[list] = None) -> list[dict]:
    """stats.jsonl records: tensor `shadow` (teacher-forced) or `shadow.model` (accumulated)."""
    return [{**base, "module": m, "tensor": kind + sfx, "stats": meas}
            for m, kind, sfx, meas in shadow_metrics(frame, plan)]
