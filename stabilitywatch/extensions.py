"""The two extension points: a `Detector` decides, a `Sink` writes. Pass instances in
`Config(detectors=(...), sinks=(...))` beside the built-in names.

This module sits low (it imports only alert and stats): config.py checks the entries against
these types, and the detectors/ and sinks/ packages, which import config, build on them.
"""
from __future__ import annotations

import abc
from typing import Any, Protocol, runtime_checkable

from .alert import Alert
from .stats.frame import StatsFrame

__all__ = ["Detector", "Sink"]


@runtime_checkable
class Detector(Protocol):
    """Decides, once per step, whether the step's statistics deserve an alert.

    `check(frame)` receives a `StatsFrame` (frames arrive in step order, one step later than
    the step ran, on the monitor's host side): `frame.step`, `frame.keys` (the (module, role)
    pairs read this step), `frame.derived(i)` (row i as a mapping of the `tensor_stats` keys),
    `frame.column(stat)` (one statistic of every row; `frame.array(stat)` the same as a numpy
    array, for a check over the whole frame at once) and `frame.sentinel` (every gradient's
    non-finite count and absmax, or None). It returns a list of `Alert` (empty when all is
    well) and must not keep the frame.

    Each Alert fills `step` (frame.step), `detector` (this detector's `name`), `severity` (a
    `Severity`), `module` and `tensor` (a key of the frame, or "" and a role for whole-model
    signals), `stat`, `value`, `threshold` and `message`. A user detector's `name` is a
    non-empty string that no built-in detector uses. A detector that raises or returns
    anything else is switched off with one warning; training goes on.
    """
    name: str

    def check(self, frame: StatsFrame) -> list[Alert]:
        """Alerts for one step's frame."""
        ...


class Sink(abc.ABC):
    """Where statistics records and alerts go.

    A sink receives stats records (dicts: schema, step, rank, world_size, module, tensor,
    stats) and Alert objects, on a thread of its own (sinks/runner.py): its methods are never
    called from two threads at once, and never from the training thread. A plug-in sink is any
    subclass, passed as an entry of Config.sinks. A call that raises (anything) or does not
    return within Config.sinks.timeout switches the sink off with one warning; training never
    waits for it.
    """
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
