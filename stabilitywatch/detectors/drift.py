"""Drift: slow or sudden changes of a tensor's scale, and how long until it overflows its format.

Per (module, role, statistic) series of log2 values (`drift.stats`, default absmax and rms):
- a robust baseline: median and 1.4826 * MAD of the previous `drift.window` samples, the scale
  floored at `drift.min_sigma_bits`; z = (x - median) / scale;
- change points: a two-sided CUSUM on z (g+ = max(0, g+ + z - k), g- likewise; alert when either
  passes h) or a single |z| >= `drift.z`. Warning when the series moved `drift.warn_bits` or more
  from its median, info otherwise; the sums restart after each alert;
- time to overflow, for roles with a format (`Config.formats`): a Theil-Sen fit (series.theil_sen) of
  log2(absmax * scale) against the step over the last `drift.forecast_points` samples; when the
  lower confidence bound of the slope is positive, steps = (log2(format max) - current) / slope,
  a warning when steps <= `drift.forecast_horizon` and the value still fits the format (past it,
  the overflow detector speaks).
Loss, logits and shadow rows belong to the spike and shadow detectors and are skipped here.
"""
from __future__ import annotations

import fnmatch
import math
from collections import deque

import numpy as np

from ..alert import Alert, Severity
from ..config import Config
from ..formats import spec
from ..stats.buffer import StatsFrame
from ..stats.frame import PerRowSet
from .base import Detector
from .series import MAD_TO_SIGMA, Rings, log2_or_none, theil_sen

SKIP_ROLES = ("loss", "logz", "logits", "attn_logits")


def _skipped(role: str, exclude) -> bool:
    return (role.startswith("shadow.") or role in SKIP_ROLES
            or any(fnmatch.fnmatchcase(role, p) for p in exclude))


class _Rings(Rings):
    """The windows of every (module, role, stat) series as rows of one array (NaN where a
    window is not full yet), with their CUSUM sums: a frame's ~1,000 series are judged with a few
    array operations instead of a Python median each. Rows are made as series.Rings makes them."""

    def __init__(self, window: int):
        self.w = window
        self.row: dict[tuple[str, str, str], int] = {}
        self._grow(64)

    def _grow(self, cap: int) -> None:
        old = getattr(self, "vals", np.empty((0, self.w)))
        n = old.shape[0]
        self.vals = np.full((cap, self.w), np.nan)
        self.vals[:n] = old
        for name in ("count", "pos"):
            a = np.zeros(cap, dtype=np.int64)
            a[:n] = getattr(self, name, a[:0])
            setattr(self, name, a)
        for name in ("gp", "gn"):
            a = np.zeros(cap)
            a[:n] = getattr(self, name, a[:0])
            setattr(self, name, a)

    def robust(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(median, 1.4826 * MAD) of each row's window: the two middle values of the sorted
        window averaged (NaN slots sort past the end), as series._median does for one list."""
        n = self.count[rows]
        lo, hi = (n - 1) // 2, n // 2
        idx = np.arange(len(rows))
        v = self.vals[rows]
        s = np.sort(v, axis=1)
        med = (s[idx, lo] + s[idx, hi]) / 2.0
        d = np.sort(np.abs(v - med[:, None]), axis=1)
        return med, MAD_TO_SIGMA * ((d[idx, lo] + d[idx, hi]) / 2.0)

    def push(self, rows: np.ndarray, x: np.ndarray) -> None:
        self.vals[rows, self.pos[rows]] = x
        self.pos[rows] = (self.pos[rows] + 1) % self.w
        self.count[rows] = np.minimum(self.count[rows] + 1, self.w)


class DriftDetector(Detector):
    name = "drift"

    def __init__(self, config: Config):
        self.cfg = config
        self._rings = _Rings(config.drift.window)
        self._trend: dict[tuple[str, str], deque] = {}
        self._plans = PerRowSet(self._plan)

    def _plan(self, keys: tuple) -> tuple:
        """(rows judged, {stat: their series in the rings}, [(row, module, role, format)] of the
        rows with a format) of a row set."""
        cfg = self.cfg
        skip: dict[str, bool] = {}
        keep = []
        for i, (_, role) in enumerate(keys):
            s = skip.get(role)
            if s is None:
                s = skip[role] = _skipped(role, cfg.drift.exclude_roles)
            if not s:
                keep.append(i)
        series = {stat: self._rings.rows([(*keys[i], stat) for i in keep])
                  for stat in cfg.drift.stats}
        fmts = []
        for i in keep:
            fmt = cfg.format_for(keys[i][1])
            if fmt is not None:
                fmts.append((i, *keys[i], fmt))
        return np.asarray(keep, dtype=np.int64), series, fmts

    def _idle_on(self, keys: tuple) -> bool:
        # no row judged (the loss, logits, shadow rows): check() returns at once
        exclude = self.cfg.drift.exclude_roles
        return all(_skipped(role, exclude) for _, role in keys)

    def check(self, frame: StatsFrame) -> list[Alert]:
        cfg = self.cfg
        keep, series, fmts = self._plans(frame)
        if not len(keep):
            return []
        found: list[tuple[int, int, Alert]] = []   # (row, order within the row, alert)
        for order, stat in enumerate(cfg.drift.stats):
            col = frame.array(stat)[keep]
            with np.errstate(invalid="ignore"):
                ok = (col > 0) & np.isfinite(col)   # series.log2_or_none
            if ok.any():
                # math.log2, as series.log2_or_none (numpy's differs in the last bit)
                xs = list(map(math.log2, col[ok].tolist()))  # sync-ok: host numpy
                found += [(i, order, a) for i, a in
                          self._change(frame, stat, keep[ok], series[stat][ok], xs)]
        late = len(cfg.drift.stats)
        if fmts:
            absmax = frame.column("absmax")
            for i, module, role, fmt in fmts:
                a = self._forecast(frame, module, role, fmt, absmax[i] * frame.scales[i])
                if a is not None:
                    found.append((i, late, a))
        found.sort(key=lambda t: (t[0], t[1]))
        return [a for _, _, a in found]

    # -- change points ----------------------------------------------------------------------
    def _change(self, frame, stat, rows: np.ndarray, series: np.ndarray,
                xs: list) -> list[tuple[int, Alert]]:
        cfg = self.cfg
        r = self._rings
        x = np.asarray(xs, dtype=np.float64)
        out = []
        ready = r.count[series] >= cfg.drift.min_history
        if ready.any():
            sel = np.flatnonzero(ready)
            e = series[sel]
            med, sigma = r.robust(e)
            sigma = np.maximum(sigma, cfg.drift.min_sigma_bits)
            z = (x[sel] - med) / sigma
            gp = np.maximum(0.0, r.gp[e] + z - cfg.drift.cusum_k)
            gn = np.maximum(0.0, r.gn[e] - z - cfg.drift.cusum_k)
            dev = x[sel] - med
            fire = (((gp > cfg.drift.cusum_h) | (gn > cfg.drift.cusum_h)
                     | (np.abs(z) >= cfg.drift.z)) & (np.abs(dev) >= cfg.drift.min_bits))
            for j in np.flatnonzero(fire).tolist():  # sync-ok: host numpy
                i = int(rows[sel[j]])
                module, role = frame.keys[i]
                zj, mj, xj, dj = float(z[j]), float(med[j]), xs[sel[j]], float(dev[j])
                how = "jump" if abs(zj) >= cfg.drift.z else "change point (CUSUM)"
                sev = Severity.WARNING if abs(dj) >= cfg.drift.warn_bits else Severity.INFO
                msg = (f"{how}: {stat} {2.0 ** xj:.4g} is {abs(dj):.1f} bits "
                       f"{'above' if dj > 0 else 'below'} its median {2.0 ** mj:.4g} over the "
                       f"last {int(r.count[e[j]])} samples (robust z {zj:+.1f}; CUSUM "
                       f"{max(gp[j], gn[j]):.1f} vs {cfg.drift.cusum_h:g})")
                out.append((i, Alert(step=frame.step, detector=self.name, severity=sev,
                                     module=module, tensor=role, stat=f"log2_{stat}", value=dj,
                                     threshold=cfg.drift.warn_bits, message=msg, rank=frame.rank,
                                     extra={"z": zj, "median": 2.0 ** mj, "value": 2.0 ** xj,
                                            "bits": dj, "change_point": True})))
                gp[j] = gn[j] = 0.0
            r.gp[e], r.gn[e] = gp, gn
        r.push(series, x)
        return out

    # -- time to overflow --------------------------------------------------------------------
    def _forecast(self, frame, module, role, fmt, amax_scaled):
        cfg = self.cfg
        y = log2_or_none(amax_scaled)
        if y is None:
            return None
        tr = self._trend.get((module, role))
        if tr is None:
            tr = self._trend[(module, role)] = deque(maxlen=cfg.drift.forecast_points)
        tr.append((frame.step, y))
        if len(tr) < cfg.drift.forecast_points:
            return None
        top = spec(fmt).max_log2
        headroom = top - y
        if headroom <= 0 or headroom > cfg.drift.forecast_max_bits:
            return None
        xs = np.array([p[0] for p in tr], dtype=np.float64)
        ys = np.array([p[1] for p in tr], dtype=np.float64)
        if ys.max() >= top:   # it overflowed inside the window: the overflow detector's
            return None
        if ys[-1] <= ys[0] or np.ptp(xs) == 0:   # cheap pre-check before the O(n^2) fit
            return None
        if _kendall_tau(xs, ys) < cfg.drift.forecast_min_tau:
            return None
        slope, lo, _ = theil_sen(ys, xs, cfg.drift.forecast_confidence)
        if not (lo > 0 and slope > 0):
            return None
        steps = headroom / slope
        if steps > cfg.drift.forecast_horizon:
            return None
        msg = (f"{role} absmax*scale {2.0 ** y:.4g} grows {slope:.3g} bits/step (Theil-Sen over "
               f"the last {len(tr)} samples, {cfg.drift.forecast_confidence:.0%} lower bound "
               f"{lo:.3g}); it reaches the {fmt} max {spec(fmt).max:g} in about {steps:.0f} "
               f"steps (step ~{frame.step + steps:.0f}); headroom {headroom:.1f} bits")
        return Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                     module=module, tensor=role, stat=f"{fmt}_steps_to_overflow", value=steps,
                     threshold=float(cfg.drift.forecast_horizon), message=msg, rank=frame.rank,
                     extra={"slope_bits_per_step": slope, "headroom_bits": headroom,
                            "overflow_step": frame.step + steps})


def _kendall_tau(xs: np.ndarray, ys: np.ndarray) -> float:
    """Kendall's tau-a of a short series (n <= ~50): concordant minus discordant pairs."""
    dx = np.sign(xs[:, None] - xs[None, :])
    dy = np.sign(ys[:, None] - ys[None, :])
    n = len(xs)
    return float((dx * dy).sum()) / (n * (n - 1))
