"""Test oracle: the drift detector's change points as they were computed before they moved to
arrays (one Python median per series per frame). The time-to-overflow forecast is the
detector's own (unchanged). tests/test_drift_vectorized.py checks that both give exactly the
same alerts."""
from __future__ import annotations

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.detectors import drift
from stabilitywatch.detectors.series import MAD_TO_SIGMA, Window, _median, log2_or_none


def _robust(win: Window) -> tuple[float, float]:
    """(median, 1.4826 * MAD) of the window."""
    a = list(win.values)
    med = _median(a)
    return med, MAD_TO_SIGMA * _median([abs(v - med) for v in a])


class _CusumState:
    __slots__ = ("win", "gp", "gn")

    def __init__(self, size: int):
        self.win, self.gp, self.gn = Window(size), 0.0, 0.0


class DriftDetector(drift.DriftDetector):
    def __init__(self, config):
        super().__init__(config)
        self._series: dict = {}

    def check(self, frame):
        out = []
        for i, (module, role) in enumerate(frame.keys):
            if drift._skipped(role, self.cfg.drift.exclude_roles):
                continue
            d = frame.derived(i)
            for stat in self.cfg.drift.stats:
                x = log2_or_none(d[stat])
                if x is not None:
                    a = self._change_one(frame, module, role, stat, x)
                    if a is not None:
                        out.append(a)
            fmt = self.cfg.format_for(role)
            if fmt is not None:
                a = self._forecast(frame, module, role, fmt, d["absmax"] * frame.scales[i])
                if a is not None:
                    out.append(a)
        return out

    def _change_one(self, frame, module, role, stat, x):
        cfg = self.cfg
        key = (module, role, stat)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _CusumState(cfg.drift.window)
        alert = None
        if len(s.win) >= cfg.drift.min_history:
            med, sigma = _robust(s.win)
            sigma = max(sigma, cfg.drift.min_sigma_bits)
            z = (x - med) / sigma
            s.gp = max(0.0, s.gp + z - cfg.drift.cusum_k)
            s.gn = max(0.0, s.gn - z - cfg.drift.cusum_k)
            dev = x - med
            if ((s.gp > cfg.drift.cusum_h or s.gn > cfg.drift.cusum_h or abs(z) >= cfg.drift.z)
                    and abs(dev) >= cfg.drift.min_bits):
                how = "jump" if abs(z) >= cfg.drift.z else "change point (CUSUM)"
                sev = Severity.WARNING if abs(dev) >= cfg.drift.warn_bits else Severity.INFO
                msg = (f"{how}: {stat} {2.0 ** x:.4g} is {abs(dev):.1f} bits "
                       f"{'above' if dev > 0 else 'below'} its median {2.0 ** med:.4g} over the "
                       f"last {len(s.win)} samples (robust z {z:+.1f}; CUSUM "
                       f"{max(s.gp, s.gn):.1f} vs {cfg.drift.cusum_h:g})")
                alert = Alert(step=frame.step, detector=self.name, severity=sev, module=module,
                              tensor=role, stat=f"log2_{stat}", value=dev,
                              threshold=cfg.drift.warn_bits, message=msg, rank=frame.rank,
                              extra={"z": z, "median": 2.0 ** med, "value": 2.0 ** x})
                s.gp = s.gn = 0.0
        s.win.push(x)
        return alert
