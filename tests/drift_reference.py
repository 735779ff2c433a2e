"""Test oracle: the drift detector as it was before its change points were computed on arrays
(one Python median per series per frame). tests/test_drift_vectorized.py checks that the
detector gives exactly these alerts.

Drift: slow or sudden changes of a tensor's scale, and how long until it overflows its format.

Per (module, role, statistic) series of log2 values (`drift_stats`, default absmax and rms):
- a robust baseline: median and 1.4826 * MAD of the previous `drift_window` samples, the scale
  floored at `drift_min_sigma_bits`; z = (x - median) / scale;
- change points: a two-sided CUSUM on z (g+ = max(0, g+ + z - k), g- likewise; alert when either
  passes h) or a single |z| >= `drift_z`. Warning when the series moved `drift_warn_bits` or more
  from its median, info otherwise; the sums restart after each alert;
- time to overflow, for roles with a format (`Config.formats`): a Theil-Sen fit (scipy) of
  log2(absmax * scale) against the step over the last `drift_forecast_points` samples; when the
  lower confidence bound of the slope is positive, steps = (log2(format max) - current) / slope,
  a warning when steps <= `drift_forecast_horizon` and the value still fits the format (past it,
  the overflow detector speaks).
Loss, logits and shadow rows belong to the spike and shadow detectors and are skipped here.
"""
from __future__ import annotations

import fnmatch
from collections import deque

import numpy as np

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.config import Config
from stabilitywatch.formats import spec
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.detectors.base import Detector
from stabilitywatch.detectors.series import MAD_TO_SIGMA, Window, _median, log2_or_none

SKIP_ROLES = ("loss", "logz", "logits", "attn_logits")


def _skipped(role: str, exclude) -> bool:
    return (role.startswith("shadow.") or role in SKIP_ROLES
            or any(fnmatch.fnmatchcase(role, p) for p in exclude))


def _robust(win: Window) -> tuple[float, float]:
    """(median, 1.4826 * MAD) of the window."""
    a = list(win.values)
    med = _median(a)
    return med, MAD_TO_SIGMA * _median([abs(v - med) for v in a])


class _CusumState:
    __slots__ = ("win", "gp", "gn")

    def __init__(self, size: int):
        self.win, self.gp, self.gn = Window(size), 0.0, 0.0


class DriftDetector(Detector):
    name = "drift"

    def __init__(self, config: Config):
        self.cfg = config
        self._series: dict[tuple[str, str, str], _CusumState] = {}
        self._trend: dict[tuple[str, str], deque] = {}

    def check(self, frame: StatsFrame) -> list[Alert]:
        out: list[Alert] = []
        for i, (module, role) in enumerate(frame.keys):
            if _skipped(role, self.cfg.drift_exclude_roles):
                continue
            d = frame.derived(i)
            for stat in self.cfg.drift_stats:
                x = log2_or_none(d[stat])
                if x is not None:
                    a = self._change(frame, module, role, stat, x)
                    if a is not None:
                        out.append(a)
            fmt = self.cfg.format_for(role)
            if fmt is not None:
                a = self._forecast(frame, module, role, fmt, d["absmax"] * frame.scales[i])
                if a is not None:
                    out.append(a)
        return out

    # -- change points ----------------------------------------------------------------------
    def _change(self, frame, module, role, stat, x):
        cfg = self.cfg
        key = (module, role, stat)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _CusumState(cfg.drift_window)
        alert = None
        if len(s.win) >= cfg.drift_min_history:
            med, sigma = _robust(s.win)
            sigma = max(sigma, cfg.drift_min_sigma_bits)
            z = (x - med) / sigma
            s.gp = max(0.0, s.gp + z - cfg.drift_cusum_k)
            s.gn = max(0.0, s.gn - z - cfg.drift_cusum_k)
            dev = x - med
            if ((s.gp > cfg.drift_cusum_h or s.gn > cfg.drift_cusum_h or abs(z) >= cfg.drift_z)
                    and abs(dev) >= cfg.drift_min_bits):
                how = "jump" if abs(z) >= cfg.drift_z else "change point (CUSUM)"
                sev = Severity.WARNING if abs(dev) >= cfg.drift_warn_bits else Severity.INFO
                msg = (f"{how}: {stat} {2.0 ** x:.4g} is {abs(dev):.1f} bits "
                       f"{'above' if dev > 0 else 'below'} its median {2.0 ** med:.4g} over the "
                       f"last {len(s.win)} samples (robust z {z:+.1f}; CUSUM "
                       f"{max(s.gp, s.gn):.1f} vs {cfg.drift_cusum_h:g})")
                alert = Alert(step=frame.step, detector=self.name, severity=sev, module=module,
                              tensor=role, stat=f"log2_{stat}", value=dev,
                              threshold=cfg.drift_warn_bits, message=msg, rank=frame.rank,
                              extra={"z": z, "median": 2.0 ** med, "value": 2.0 ** x})
                s.gp = s.gn = 0.0
        s.win.push(x)
        return alert

    # -- time to overflow --------------------------------------------------------------------
    def _forecast(self, frame, module, role, fmt, amax_scaled):
        cfg = self.cfg
        y = log2_or_none(amax_scaled)
        if y is None:
            return None
        tr = self._trend.get((module, role))
        if tr is None:
            tr = self._trend[(module, role)] = deque(maxlen=cfg.drift_forecast_points)
        tr.append((frame.step, y))
        if len(tr) < cfg.drift_forecast_points:
            return None
        top = spec(fmt).max_log2
        headroom = top - y
        if headroom <= 0 or headroom > cfg.drift_forecast_max_bits:
            return None
        xs = np.array([p[0] for p in tr], dtype=np.float64)
        ys = np.array([p[1] for p in tr], dtype=np.float64)
        if ys.max() >= top:   # it overflowed inside the window: the overflow detector's
            return None
        if ys[-1] <= ys[0] or np.ptp(xs) == 0:   # cheap pre-check before the O(n^2) fit
            return None
        if _kendall_tau(xs, ys) < cfg.drift_forecast_min_tau:
            return None
        from scipy.stats import theilslopes
        slope, _, lo, _ = theilslopes(ys, xs, alpha=cfg.drift_forecast_confidence)
        if not (lo > 0 and slope > 0):
            return None
        steps = headroom / slope
        if steps > cfg.drift_forecast_horizon:
            return None
        msg = (f"{role} absmax*scale {2.0 ** y:.4g} grows {slope:.3g} bits/step (Theil-Sen over "
               f"the last {len(tr)} samples, {cfg.drift_forecast_confidence:.0%} lower bound "
               f"{lo:.3g}); it reaches the {fmt} max {spec(fmt).max:g} in about {steps:.0f} "
               f"steps (step ~{frame.step + steps:.0f}); headroom {headroom:.1f} bits")
        return Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                     module=module, tensor=role, stat=f"{fmt}_steps_to_overflow", value=steps,
                     threshold=float(cfg.drift_forecast_horizon), message=msg, rank=frame.rank,
                     extra={"slope_bits_per_step": slope, "headroom_bits": headroom,
                            "overflow_step": frame.step + steps})


def _kendall_tau(xs: np.ndarray, ys: np.ndarray) -> float:
    """Kendall's tau-a of a short series (n <= ~50): concordant minus discordant pairs."""
    dx = np.sign(xs[:, None] - xs[None, :])
    dy = np.sign(ys[:, None] - ys[None, :])
    n = len(xs)
    return float((dx * dy).sum()) / (n * (n - 1))
