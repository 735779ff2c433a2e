"""Your own detectors (Detector instances in Config.detectors), run under the rule every part
of the monitor follows: a detector that fails is switched off with one warning, and training
goes on."""
from __future__ import annotations

import logging

from ..alert import Alert, Severity
from ..stats.frame import StatsFrame
from .base import Detector

log = logging.getLogger("stabilitywatch")


class UserDetector(Detector):
    def __init__(self, detector):
        self.detector = detector
        self.name = detector.name
        self.on = True

    def check(self, frame: StatsFrame) -> list[Alert]:
        if not self.on:
            return []
        try:
            alerts = self.detector.check(frame)
            if not isinstance(alerts, (list, tuple)):
                raise TypeError(f"check() returned {type(alerts).__name__}, not a list of Alert")
            for a in alerts:
                _check_alert(a, self.name)
            return list(alerts)
        except Exception as e:
            self.on = False
            log.warning("stabilitywatch: detector %r failed at step %s (%s: %s); switched off, "
                        "the run goes on", self.name, frame.step, type(e).__name__, e)
            return []

    def __repr__(self) -> str:
        return f"<user detector {self.name!r}: {self.detector!r}>"


def _check_alert(a, name: str) -> None:
    # what the monitor relies on downstream (cooldown, incidents, sinks): checked here, where a
    # wrong value is still the detector's fault
    if not isinstance(a, Alert):
        raise TypeError(f"check() returned {type(a).__name__} in its list, not an Alert")
    if a.detector != name:
        raise ValueError(f"an Alert with detector={a.detector!r}; it must carry the "
                         f"detector's name {name!r}")
    if not isinstance(a.severity, Severity):
        raise TypeError(f"an Alert with severity={a.severity!r}; use stabilitywatch.Severity")
    for field in ("module", "tensor", "stat", "message"):
        if not isinstance(getattr(a, field), str):
            raise TypeError(f"an Alert with {field}={getattr(a, field)!r}, not a string")
    if isinstance(a.step, bool) or not isinstance(a.step, int):
        raise TypeError(f"an Alert with step={a.step!r}, not an int")
