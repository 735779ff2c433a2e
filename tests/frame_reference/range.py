"""Overflow and underflow risk for the format each tensor role is cast to (Config.formats)."""
from __future__ import annotations

import math

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.config import Config
from stabilitywatch.formats import spec
from stabilitywatch.stats.buffer import StatsFrame
from stabilitywatch.detectors.base import Detector


class RangeDetector(Detector):
    """Warns when the fraction of values that would saturate (overflow) or flush to zero
    (underflow) in the role's format passes the configured thresholds."""

    name = "range"

    def __init__(self, config: Config):
        self.config = config

    def check(self, frame: StatsFrame) -> list[Alert]:
        cfg = self.config
        out: list[Alert] = []
        for i, (module, role) in enumerate(frame.keys):
            fmt = None if role.startswith("shadow.") else cfg.format_for(role)
            if fmt is None:
                continue
            d = frame.derived(i)
            if d["finite"] < cfg.range.min_numel:
                continue
            scale = frame.scales[i]
            f = spec(fmt)
            over = d[f"{fmt}_overflow_frac"]
            sev = _severity(over, cfg.range.overflow_warn, cfg.range.overflow_critical)
            if sev is not None:
                rng = cfg.range
                thr = rng.overflow_critical if sev is Severity.CRITICAL else rng.overflow_warn
                msg = (f"{int(d[f'{fmt}_overflow'])} of {int(d['finite'])} values "
                       f"({over:.3%}) exceed the {fmt} max {f.max:g} at scale {scale:g} "
                       f"(absmax {d['absmax']:.4g}, headroom {_bits(d[f'{fmt}_headroom_bits'])})")
                out.append(Alert(step=frame.step, detector="overflow", severity=sev,
                                 module=module, tensor=role, stat=f"{fmt}_overflow_frac",
                                 value=over, threshold=thr, message=msg, rank=frame.rank))
            under = d[f"{fmt}_underflow_frac"]
            sev = _severity(under, cfg.range.underflow_warn, cfg.range.underflow_critical)
            if sev is not None:
                rng = cfg.range
                thr = rng.underflow_critical if sev is Severity.CRITICAL else rng.underflow_warn
                nonzero = d["finite"] - d["zeros"]
                msg = (f"{int(d[f'{fmt}_underflow'])} of {int(nonzero)} nonzero values "
                       f"({under:.3%}) round to zero in {fmt} at scale {scale:g} "
                       f"(smallest |x| {d['absmin_nonzero']:.4g}, {fmt} min subnormal "
                       f"{f.min_subnormal:g})")
                out.append(Alert(step=frame.step, detector="underflow", severity=sev,
                                 module=module, tensor=role, stat=f"{fmt}_underflow_frac",
                                 value=under, threshold=thr, message=msg, rank=frame.rank))
        return out


def _severity(frac: float, warn: float, crit: float):
    if frac > crit:
        return Severity.CRITICAL
    if frac > warn:
        return Severity.WARNING
    return None


def _bits(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.1f} bits"
