"""Overflow and underflow risk for the format each tensor role is cast to (Config.formats)."""
from __future__ import annotations

import math

import numpy as np

from ..alert import Alert, Severity
from ..config import Config
from ..formats import spec
from ..stats.buffer import StatsFrame
from ..stats.frame import PerRowSet
from .base import Detector


class RangeDetector(Detector):
    """Warns when the fraction of values that would saturate (overflow) or flush to zero
    (underflow) in the role's format passes the configured thresholds."""

    name = "range"

    def __init__(self, config: Config):
        self.config = config
        self._plans = PerRowSet(self._plan)

    def _plan(self, keys: tuple) -> list[tuple[str, np.ndarray]]:
        """(format, the rows cast to it) of a row set (shadow.* rows are a replica's)."""
        by_fmt: dict[str, list] = {}
        for i, (_, role) in enumerate(keys):
            fmt = None if role.startswith("shadow.") else self.config.format_for(role)
            if fmt is not None:
                by_fmt.setdefault(fmt, []).append(i)
        return [(fmt, np.asarray(ix, dtype=np.int64)) for fmt, ix in by_fmt.items()]

    def _idle_on(self, keys: tuple) -> bool:
        return not self._plan(keys)   # check() returns at once without a row to judge

    def check(self, frame: StatsFrame) -> list[Alert]:
        plan = self._plans(frame)
        if not plan:
            return []
        cfg = self.config
        rng = cfg.range
        finite = frame.array("finite")
        trip: list[tuple[int, str]] = []
        for fmt, ix in plan:   # the thresholds over whole columns; Python for the rows over them
            over = frame.array(f"{fmt}_overflow_frac")[ix]
            under = frame.array(f"{fmt}_underflow_frac")[ix]
            hit = (~(finite[ix] < rng.min_numel)
                   & ((over > rng.overflow_warn) | (over > rng.overflow_critical)
                      | (under > rng.underflow_warn) | (under > rng.underflow_critical)))
            trip += [(i, fmt) for i in ix[hit].tolist()]  # sync-ok: host numpy
        trip.sort()
        out: list[Alert] = []
        for i, fmt in trip:
            module, role = frame.keys[i]
            d = frame.derived(i)
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
