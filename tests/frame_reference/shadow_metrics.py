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

from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.stats.layout import Stat

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


def shadow_metrics(frame: StatsFrame) -> list[tuple[str, str, str, dict[str, float]]]:
    """[(module, kind, output suffix, measures)] for every shadow error row of the frame."""
    out = []
    for i, (module, role) in enumerate(frame.keys):
        if not role.startswith("shadow"):  # most rows; checked at C speed before _split
            continue
        split = _split(role)
        if split is None:
            continue
        kind, sfx = split
        e = frame.rows[i]
        s = _row(frame, module, f"{kind}.output{sfx}")
        u = _row(frame, module, f"{kind}.ulp{sfx}")
        y = _row(frame, module, f"output{sfx}")
        if y is None:
            y = _row(frame, module, f"shadow.live{sfx}")
        if s is None:
            continue
        e2, s2 = float(e[Stat.SUMSQ]), float(s[Stat.SUMSQ])
        m = {"rel_l2": math.sqrt(e2 / s2) if s2 > 0 else (0.0 if e2 == 0 else math.inf),
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


def _row(frame: StatsFrame, module: str, role: str):
    i = frame.index(module, role)
    return None if i is None else frame.rows[i]


def shadow_records(frame: StatsFrame, base: dict) -> list[dict]:
    """stats.jsonl records: tensor `shadow` (teacher-forced) or `shadow.model` (accumulated)."""
    return [{**base, "module": m, "tensor": kind + sfx, "stats": meas}
            for m, kind, sfx, meas in shadow_metrics(frame)]
