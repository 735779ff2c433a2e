"""The Sink ABC: where statistics records and alerts go.

A sink receives stats records (dicts: schema, step, rank, world_size, module, tensor, stats) and
Alert objects, on a thread of its own (runner.py): its methods are never called from two threads
at once, and never from the training thread. A plug-in sink is any subclass, passed as an entry
of Config.sinks.use. A call that raises (anything) or does not return within Config.sinks.timeout
switches the sink off with one warning; training never waits for it.
"""
from __future__ import annotations

import abc
import logging
from typing import Any

from ..alert import Alert

log = logging.getLogger("stabilitywatch")


class Sink(abc.ABC):
    name = "sink"

    @abc.abstractmethod
    def log(self, records: list[dict[str, Any]]) -> None:
        """Write per-step statistics records."""

    @abc.abstractmethod
    def alert(self, alert: Alert) -> None:
        """Write one alert (as soon as it happens)."""

    def flush(self) -> None:
        """Make what was written durable (optional)."""

    def close(self) -> None:
        """Flush and release resources."""

    def lost(self) -> dict[str, Any]:
        """What this sink was handed but could not write by itself, e.g. statistics dropped on a
        full disk: {"alerts": n, "records": n, "note": why} (optional; run.json carries it)."""
        return {}

    def __repr__(self) -> str:
        return f"<sink {self.name!r}: {type(self).__module__}.{type(self).__qualname__}>"
