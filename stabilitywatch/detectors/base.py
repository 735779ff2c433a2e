"""The Detector protocol (defined in stabilitywatch/extensions.py) and the cooldown that keeps
repeated alerts from flooding sinks."""
from __future__ import annotations

from ..alert import Alert
from ..extensions import Detector

__all__ = ["Cooldown", "Detector", "idle"]


def idle(detector, keys: tuple) -> bool:
    """True when `detector` has nothing to read in a frame with these keys: its check() would
    return no alert and change no state (a built-in detector says so through `_idle_on(keys)`;
    any other detector is always run). A frame of an unsampled step (the loss row and the
    sentinel) leaves most of them idle."""
    fn = getattr(detector, "_idle_on", None)
    return fn is not None and fn(keys) is True


class Cooldown:
    """Lets an alert through unless the same (detector, module, tensor, stat) alerted at the
    same or a higher severity less than `steps` steps ago."""

    def __init__(self, steps: int):
        self.steps = steps
        self._last: dict[tuple, tuple[int, int]] = {}

    def allow(self, a: Alert) -> bool:
        key = (a.detector, a.module, a.tensor, a.stat)
        prev = self._last.get(key)
        sev = a.severity.rank
        if prev is not None and a.step - prev[0] < self.steps and sev <= prev[1]:
            return False
        self._last[key] = (a.step, sev)
        return True
