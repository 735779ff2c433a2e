"""The sinks' sub-config (`Config.sinks`; README "Sinks, and the numbers in W&B"): which sinks,
their queues and timeouts, and what the dashboards (W&B, TensorBoard) show."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config_base import check_bool, did_you_mean
from .extensions import Sink
from .config_dashboards import WANDB_RUN_MODES, check_dashboard_stats

SINK_NAMES = ("jsonl", "console", "wandb", "tensorboard")


def _set(obj, name, value):
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in __post_init__


@dataclass(frozen=True, kw_only=True)
class SinkConfig:
    """Where records and alerts go. `Config(sinks=["jsonl", "wandb"])` is short for
    `Config(sinks=SinkConfig(use=("jsonl", "wandb")))`."""
    use: tuple[Any, ...] = ("jsonl", "console")
    """Any of: jsonl, console, wandb, tensorboard, and stabilitywatch.sinks.Sink instances
    (plug-in sinks, used as they are)."""
    queue_size: int = 1024
    """Steps of statistics records each sink's queue holds (when full, records are dropped for
    that sink, counted, never waited for; alerts have their own queue and are never dropped)."""
    timeout: float = 10.0
    """Seconds one call of a sink (log, alert, flush) may take; a sink that takes longer is
    switched off (one warning, never called again) and what it had not written is counted in
    run.json. Training never waits for it either way."""
    close_timeout: float = 30.0
    """Seconds close() gives the sinks in all to write what is queued and close; a sink not done
    by then is abandoned (one warning naming it; counted in run.json)."""
    wandb_project: str = "stabilitywatch"
    """W&B project of a run the monitor starts itself (see `wandb_run`)."""
    wandb_run: str = "auto"
    """Which W&B run the wandb sink logs to. "auto": the run you start with wandb.init, before
    or after watch(); if there is none by close(), a run of the monitor's own, started then.
    "attach": only yours (nothing reaches W&B without one). "own": a run of its own, started
    at watch() (then do not call wandb.init yourself in this process)."""
    dashboard_stats: tuple[str, ...] = ("default",)
    """What the dashboards (W&B and TensorBoard) show per (module, role): "default" (absmax,
    rms, nonfinite, the overflow and underflow fractions of the role's configured format; loss
    mean, gradient norm, shadow rel_l2; biases and raw shadow rows left out), statistic names
    or globs added for the roles shown ("mean", "e5m2_*"), and "ROLE:STAT" globs for any role
    ("grad*:std", "*bias:absmax"). A list without "default" shows only what it names.
    stats.jsonl keeps every statistic whatever this says."""
    dashboard_histograms: bool = True
    """Exponent histograms (floor(log2|x|) counts) of the rows shown, on sampled steps."""

    def __post_init__(self) -> None:
        use = self.use
        _set(self, "use", tuple(use) if isinstance(use, (tuple, list)) else (use,))
        _check_sinks(self.use)
        v = self.queue_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Config.sinks.queue_size must be an integer >= 1, got {v!r}")
        for name in ("timeout", "close_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"Config.sinks.{name} must be a positive number of seconds, "
                                 f"got {v!r}")
            _set(self, name, float(v))
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ValueError(f"Config.sinks.wandb_project must be a non-empty string, "
                             f"got {self.wandb_project!r}")
        if self.wandb_run not in WANDB_RUN_MODES:
            raise ValueError(f"Config.sinks.wandb_run must be one of {WANDB_RUN_MODES}, got "
                             f"{self.wandb_run!r}{did_you_mean(self.wandb_run, WANDB_RUN_MODES)}")
        _set(self, "dashboard_stats", check_dashboard_stats(self.dashboard_stats,
                                                            "sinks.dashboard_stats"))
        check_bool(self.dashboard_histograms, "sinks.dashboard_histograms")


def _check_sinks(sinks) -> None:

    seen: list = []
    for s in sinks:
        if isinstance(s, str):
            if s not in SINK_NAMES:
                raise ValueError(f"Config.sinks: unknown sink {s!r}{did_you_mean(s, SINK_NAMES)} "
                                 f"(expected any of {SINK_NAMES} or a stabilitywatch.sinks.Sink "
                                 f"instance)")
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
