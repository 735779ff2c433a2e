"""Sink ABC and the fan-out that runs sinks on a background thread behind a bounded queue.

A sink receives stats records (dicts: schema, step, rank, world_size, module, tensor, stats) and
Alert objects. A sink that raises is switched off with one warning; training never waits on a
slow sink except for alerts, which wait briefly for queue space rather than being dropped.
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
