"""Checks of Config's sink fields (README "Sinks"): sinks hold names or Sink instances, the
timeouts are positive numbers of seconds."""
from __future__ import annotations

import math

from .extensions import Sink

SINK_NAMES = ("jsonl", "console", "wandb", "tensorboard")


def validate_sink_fields(cfg) -> None:
    seen: list = []
    for s in cfg.sinks:
        if isinstance(s, str):
            if s not in SINK_NAMES:
                raise ValueError(f"Config.sinks: unknown sink {s!r}; expected any of "
                                 f"{SINK_NAMES} or a stabilitywatch.sinks.Sink instance")
        elif isinstance(s, type) and issubclass(s, Sink):
            raise ValueError(f"Config.sinks: {s.__name__} is a Sink class; pass an instance, "
                             f"{s.__name__}(...)")
        elif not isinstance(s, Sink):
            raise ValueError(f"Config.sinks must hold sink names {SINK_NAMES} or "
                             f"stabilitywatch.sinks.Sink instances, got {s!r} "
                             f"({type(s).__name__})")
        if any(s is t or (isinstance(s, str) and s == t) for t in seen):
            # one sink on two threads at once, or two writers of one file
            raise ValueError(f"Config.sinks: {s!r} appears twice")
        seen.append(s)
    for name in ("sink_timeout", "sink_close_timeout"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"Config.{name} must be a positive number of seconds, got {v!r}")
