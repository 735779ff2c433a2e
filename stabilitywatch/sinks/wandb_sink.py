"""Weights & Biases sink: per-layer health charts on their own step axis, alerts, alert table.

If a W&B run is already active (`wandb.run`), the charts go into it, next to the user's loss,
and the run is left open on close. Otherwise the sink starts its own run and finishes it on
close; call `wandb.init()` before creating the monitor to get the first behaviour.
"""
from __future__ import annotations

import collections
import os
import time
from typing import Any, Iterable, Optional

from ..alert import Alert, Severity
from .base import Sink
from .tensorboard_sink import DEFAULT_STATS_KEYS

PREFIX = "stabilitywatch"
STEP_KEY = f"{PREFIX}/step"
ALERT_COLUMNS = ["step", "rank", "detector", "severity", "module", "tensor", "stat", "value",
                 "threshold", "message", "capture"]


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, run_dir: str | os.PathLike, project: str = "stabilitywatch",
                 run_name: Optional[str] = None, stats_keys: Iterable[str] = DEFAULT_STATS_KEYS,
                 alerts_per_minute: float = 6, rank: int = 0):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbSink needs wandb: pip install stabilitywatch[wandb]") from e
        self._wandb = wandb
        self.rank = int(rank)
        self.stats_keys = tuple(stats_keys)
        self.alerts_per_minute = float(alerts_per_minute)
        if wandb.run is not None:
            self.run, self.owns_run = wandb.run, False
        else:
            run_dir = os.fspath(run_dir)
            os.makedirs(run_dir, exist_ok=True)
            if run_name is not None and self.rank != 0:
                run_name = f"{run_name}-rank{self.rank}"
            # "create_new": never adopt or finish a run that someone else started.
            self.run = wandb.init(project=project, name=run_name, dir=run_dir,
                                  reinit="create_new", config={f"{PREFIX}/rank": self.rank})
            self.owns_run = True
        # Our own x-axis: the user's wandb step (and their charts) stay theirs.
        self.run.define_metric(STEP_KEY)
        self.run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)
        self.alerts: list[Alert] = []
        self.suppressed = 0          # alerts held back by the rate limit since the last one sent
        self.suppressed_total = 0
        self._sent_at: collections.deque[float] = collections.deque()
        self._clock = time.monotonic
        self._closed = False

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed:
            return
        rows: dict[int, dict[str, float]] = {}
        for r in records:
            step = int(r["step"])
            row = rows.setdefault(step, {STEP_KEY: step})
            prefix = f"{PREFIX}/{r['module'] or 'model'}/{r['tensor']}"
            stats = r.get("stats", {})
            for key in self.stats_keys:
                if key in stats:
                    row[f"{prefix}/{key}"] = float(stats[key])
        for row in rows.values():
            self.run.log(row)

    def alert(self, alert: Alert) -> None:
        if self._closed:
            return
        self.alerts.append(alert)
        self.run.log({STEP_KEY: int(alert.step), f"{PREFIX}/alerts/count": len(self.alerts)})
        if not self._may_send():
            self.suppressed += 1
            self.suppressed_total += 1
            return
        text = alert.line()
        if self.suppressed:
            text += (f"\n({self.suppressed} earlier alert(s) held back by the limit of "
                     f"{self.alerts_per_minute:g}/min; all are in the {PREFIX}/alerts table)")
        title = f"{PREFIX}: {alert.detector} in {alert.module or 'model'} {alert.tensor}"[:63]
        level = {Severity.INFO: "INFO", Severity.WARNING: "WARN", Severity.CRITICAL: "ERROR"}
        try:
            # wait_duration is W&B's own per-title throttle; ours above replaces it.
            self.run.alert(title=title, text=text, wait_duration=1,
                           level=getattr(self._wandb.AlertLevel, level[Severity(alert.severity)]))
        except Exception:
            # Alerting can fail (offline, no notification integration); charts still work.
            return
        self.suppressed = 0

    def _may_send(self) -> bool:
        """Sliding one-minute window."""
        now = self._clock()
        while self._sent_at and now - self._sent_at[0] >= 60.0:
            self._sent_at.popleft()
        if len(self._sent_at) >= self.alerts_per_minute:
            return False
        self._sent_at.append(now)
        return True

    def alert_table(self):
        rows = []
        for a in self.alerts:
            rows.append([int(a.step), int(a.rank), a.detector, Severity(a.severity).value, a.module,
                         a.tensor, a.stat, float(a.value), float(a.threshold), a.message,
                         a.capture])
        return self._wandb.Table(columns=ALERT_COLUMNS, data=rows)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run.log({f"{PREFIX}/alerts": self.alert_table()})
            self.run.summary[f"{PREFIX}/alerts/suppressed"] = self.suppressed_total
        finally:
            if self.owns_run:
                self.run.finish()
