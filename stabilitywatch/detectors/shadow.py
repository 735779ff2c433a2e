"""Shadow: a module's error against its higher-precision replica (see stabilitywatch/shadow).

Per module output (teacher-forced: stat `rel_l2`; whole-model, accumulated: `model_rel_l2`):
warning when the relative L2 error passes `shadow.rel_warn`, critical past `shadow.rel_critical`;
a warning when it grew to `shadow.growth` x its baseline (median of its first `shadow.baseline`
shadow steps) while above `shadow.growth_floor`. SQNR, cosine, max abs and max ULP error ride
along in the message and in `extra`.
"""
from __future__ import annotations

import math

from ..alert import Alert, Severity
from ..config import Config
from ..shadow.metrics import shadow_metrics, shadow_plan
from ..stats.frame import PerRowSet
from ..stats.buffer import StatsFrame
from .base import Detector
from .series import Window


class ShadowDetector(Detector):
    name = "shadow"

    def __init__(self, config: Config):
        self.cfg = config
        self._hist: dict[tuple[str, str, str], Window] = {}
        self._plans = PerRowSet(shadow_plan)

    def _idle_on(self, keys: tuple) -> bool:
        return not shadow_plan(keys)   # no error row with its shadow row: nothing to judge

    def check(self, frame: StatsFrame) -> list[Alert]:
        cfg, out = self.cfg, []
        for module, kind, sfx, m in shadow_metrics(frame, self._plans(frame)):
            rel = m["rel_l2"]
            if math.isnan(rel):
                continue
            key = (module, kind, sfx)
            w = self._hist.get(key)
            if w is None:
                w = self._hist[key] = Window(cfg.shadow.baseline, early=cfg.shadow.baseline)
            base = w.baseline
            w.push(rel)
            stat = "rel_l2" if kind == "shadow" else "model_rel_l2"
            what = ("its " + cfg.shadow.dtype + " replica on the same inputs" if kind == "shadow"
                    else "a whole-model " + cfg.shadow.dtype + " forward (accumulated error)")
            detail = (f"SQNR {m['sqnr_db']:.1f} dB, cosine {m['cosine']:.6f}, max abs error "
                      f"{m['max_abs_err']:.3g}, max {m.get('max_ulp', math.nan):.3g} ULP")
            if rel > cfg.shadow.rel_warn:
                crit = rel > cfg.shadow.rel_critical
                thr = cfg.shadow.rel_critical if crit else cfg.shadow.rel_warn
                msg = f"output{sfx} differs from {what} by {rel:.3g} relative L2 ({detail})"
                out.append(Alert(step=frame.step, detector=self.name,
                                 severity=Severity.CRITICAL if crit else Severity.WARNING,
                                 module=module, tensor="output" + sfx, stat=stat, value=rel,
                                 threshold=thr, message=msg, rank=frame.rank, extra=dict(m)))
            elif (not math.isnan(base) and rel > cfg.shadow.growth_floor
                  and rel > cfg.shadow.growth * base):
                msg = (f"error of output{sfx} against {what} grew to {rel:.3g} relative L2, "
                       f"x{rel / base if base > 0 else math.inf:.1f} its baseline {base:.3g} "
                       f"({detail})")
                out.append(Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                                 module=module, tensor="output" + sfx, stat=stat + "_growth",
                                 value=rel, threshold=cfg.shadow.growth * base, message=msg,
                                 rank=frame.rank, extra={**m, "baseline": base}))
        return out
