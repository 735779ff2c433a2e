"""Console sink: one log line per alert through the "stabilitywatch" logger."""
from __future__ import annotations

import logging
from typing import Any

from ..alert import Alert, Severity
from .base import Sink

_LEVELS = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING,
           Severity.CRITICAL: logging.ERROR}


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, min_severity: str | Severity = "info"):
        try:
            self.min_severity = Severity(min_severity)
        except ValueError:
            choices = ", ".join(s.value for s in Severity)
            raise ValueError(f"min_severity must be one of {choices}, got {min_severity!r}") from None
        self._log = logging.getLogger("stabilitywatch")

    def log(self, records: list[dict[str, Any]]) -> None:
        # Per-step statistics are far too many for a console; they go to the other sinks.
        pass

    def alert(self, alert: Alert) -> None:
        severity = Severity(alert.severity)
        if severity.rank >= self.min_severity.rank:
            # an incident's consequences are listed in its root's line: theirs are debug
            level = logging.DEBUG if alert.incident and not alert.root else _LEVELS[severity]
            self._log.log(level, alert.line())
