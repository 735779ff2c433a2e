"""Weights & Biases sink: per-layer health charts, alerts and the alerts table, in your run.

Your step counter stays yours. In a run you started, the sink never passes `step=` and never
commits a row: each step's values go into the row your next `wandb.log` commits
(`commit=False`), one step of the monitor per row, plotted against the sink's own x-axis
`sw/step` (`define_metric`), so `wandb.log(..., step=step)` keeps every point. It attaches to
`wandb.run` whenever there is one, also one you start after `watch()`, and holds what comes
before (it never starts a run your `wandb.init` would then run into). See Config.sinks.wandb_run.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Optional

from ..alert import Alert, Severity
from .base import Sink
from .dashboard import PREFIX, STEP_KEY, Dashboard, hist_edges, run_config
from .wandb_alerts import AlertPlan, Message

log = logging.getLogger("stabilitywatch")

CONFIG_KEY = "stabilitywatch"
TABLE_KEY = f"{PREFIX}.alerts/table"
DROPPED_KEY = f"{PREFIX}/rows_dropped"
ALERT_COLUMNS = ["step", "rank", "detector", "severity", "module", "tensor", "stat", "value",
                 "threshold", "message", "capture"]
MAX_BACKLOG = 32     # steps waiting for a row of yours; the smallest go first past this
MAX_HELD = 256       # steps held while there is no run yet
PUMP_INTERVAL = 0.02  # s between looks at your run's step while steps wait for a row


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, run_dir: str | os.PathLike, project: str = "stabilitywatch",
                 run_name: Optional[str] = None, config=None, rank: int = 0, world_size: int = 1,
                 run: str = "auto", dashboard: Optional[Dashboard] = None,
                 alerts_per_minute: Optional[dict] = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbSink needs wandb: pip install stabilitywatch[wandb]") from e
        if run not in ("auto", "attach", "own"):
            raise ValueError(f"WandbSink: run must be 'auto', 'attach' or 'own', got {run!r}")
        if dashboard is None:
            from ..config import Config
            dashboard = Dashboard.from_config(config if config is not None else Config())
        self._wandb = wandb
        self.run_dir, self.project, self.mode = os.fspath(run_dir), project, run
        self.run_name = run_name if run_name is None or not rank else f"{run_name}-rank{rank}"
        self.rank, self.world_size = int(rank), int(world_size)
        self.dashboard = dashboard
        self.config = run_config(config, self.rank, self.world_size)
        self.run = None
        self.owns_run = False
        self.alerts: list[Alert] = []
        self.dropped = 0                     # steps that never reached W&B
        self.plan = AlertPlan(alerts_per_minute)
        self._counts = {s: 0 for s in Severity}
        self._rows: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._row_step: Optional[int] = None     # W&B step of the row holding our last values
        self._unsent: list[Message] = []
        self._inbox: collections.deque = collections.deque()
        self._table_dirty = False
        self._attached_once = False
        self._dead_runs: set[int] = set()
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._closed = False
        self._wake = threading.Event()
        self._pump: Optional[threading.Thread] = None
        if run == "own":
            self._start_own_run()
        else:
            self._find_run()

    # -- the Sink interface -------------------------------------------------------------------
    def log(self, records: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._closed:
                return
            self._find_run()
            self._take_alerts()
            self._send(self.plan.close_batch())    # the step's alerts came before its records
            self._add(records)
            self._drain()

    def alert(self, alert: Alert) -> None:
        # May run on the training thread while the sink's thread is inside wandb: never wait
        # there; the alert is taken now or by the next call.
        self._inbox.append(alert)
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self._find_run()
                self._take_alerts()   # its counts go out with the step's values (log())
        finally:
            self._lock.release()

    def flush(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._find_run()
            self._take_alerts()
            self._send(self.plan.close_batch())
            self._drain()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.set()
            try:
                self._take_alerts()
                self._send(self.plan.final())
                self._find_run()
                if (self.run is None and self.mode == "auto" and not self._attached_once
                        and (self._rows or self.alerts)):
                    self._start_own_run()
                self._drain()
                why = ("no row of yours was left to carry them" if self.run is not None
                       else "there was no W&B run to take them")
                self._drop(len(self._rows), why)
                self._rows.clear()
                self._write_summary()
            finally:
                if self.owns_run and self.run is not None:
                    self.run.finish()

    # -- rows ---------------------------------------------------------------------------------
    def _add(self, records: list[dict[str, Any]]) -> None:
        dash = self.dashboard
        for r in records:
            row = self._row(int(r["step"]))
            keys, vals = dash.values(r)
            row.update(zip(keys, vals))
            h = dash.histogram(r)
            if h is not None:
                row[h[0]] = (h[1], h[2])    # made a wandb.Histogram when sent

    def _row(self, step: int) -> dict:
        row = self._rows.get(step)
        if row is None:
            row = self._rows[step] = {}
        return row

    def _drain(self) -> None:
        if self.run is not None and not self.owns_run and _finished(self.run):
            self._gone("it was finished")
        if self.run is None:
            return self._bound(MAX_HELD)
        while self._rows:
            if self.owns_run:
                step, row = self._rows.popitem(last=False)
                self._log(step, row, commit=True)
                continue
            if not self._drain_once():
                break
            if self.run is None:
                return self._bound(MAX_HELD)
        self._bound(MAX_BACKLOG)
        if self._rows:
            self._start_pump()

    def _start_pump(self) -> None:
        # Steps wait for your next wandb.log; between the sink's own calls (one per step) a
        # thread looks for it, so a loop that logs faster than frames arrive still gets them.
        self._wake.set()
        if self._pump is None:
            self._pump = threading.Thread(target=self._pump_loop, daemon=True,
                                          name="stabilitywatch-wandb-rows")
            self._pump.start()

    def _pump_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            if self._closed:
                return
            with self._lock:
                if self._closed:
                    return
                if self.run is not None and not self.owns_run and _finished(self.run):
                    self._gone("it was finished")
                if not self._rows or self.run is None or self.owns_run:
                    self._wake.clear()
                    continue
                try:
                    self._drain_once()
                except Exception as e:
                    self._warn("pump", f"writing held steps failed ({type(e).__name__}: {e})")
                    self._wake.clear()
            threading.Event().wait(PUMP_INTERVAL)

    def _drain_once(self) -> bool:
        """One step into your open row, if it holds none of ours yet."""
        now = self._wandb_step()
        if self._row_step is not None and now is not None and now <= self._row_step:
            return False   # the row we wrote last is still open: wait for your next wandb.log
        step, row = self._rows.popitem(last=False)
        if self._log(step, row, commit=False):
            # read after writing: a row you committed meanwhile makes this later, never earlier
            self._row_step = self._wandb_step()
        return True

    def _log(self, step: int, row: dict, commit: bool) -> bool:
        wandb = self._wandb
        data = {STEP_KEY: step}
        for k, v in row.items():
            if isinstance(v, tuple):
                first, counts = v
                v = wandb.Histogram(np_histogram=(counts, hist_edges(first, len(counts))))
            data[k] = v
        try:
            self.run.log(data, commit=commit)
            return True
        except Exception as e:
            if self.owns_run:
                raise
            self._rows[step] = row
            self._rows.move_to_end(step, last=False)
            self._gone(f"it refused a log ({type(e).__name__}: {e})")
            return False

    def _gone(self, why: str) -> None:
        # your run was finished (or broke) before close(): look for another one
        self._warn("gone", f"W&B run {getattr(self.run, 'id', '?')} left: {why}; "
                   "waiting for another run")
        self._dead_runs.add(id(self.run))
        self.run = None

    def _wandb_step(self) -> Optional[int]:
        try:
            return int(self.run.step)
        except Exception:   # "shared" mode runs have no step counter
            return None

    def _bound(self, limit: int) -> None:
        while len(self._rows) > limit:
            # the step with the fewest values first (a loss-only step before a sampled one)
            step = min(self._rows, key=lambda s: len(self._rows[s]))
            del self._rows[step]
            self._drop(1, "you log to W&B less often than the monitor samples; stats.jsonl "
                          "has them all")

    def _drop(self, n: int, why: str) -> None:
        if n <= 0:
            return
        self.dropped += n
        self._warn("drop", f"some steps' statistics did not reach W&B ({why})")

    # -- runs ---------------------------------------------------------------------------------
    def _find_run(self) -> None:
        if self.run is not None or self.mode == "own":
            return
        run = self._wandb.run
        if run is not None and id(run) not in self._dead_runs and not _finished(run):
            self._use(run, owns=False)

    def _start_own_run(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        # "create_new": never adopt, replace or finish a run of yours
        run = self._wandb.init(project=self.project, name=self.run_name, dir=self.run_dir,
                               reinit="create_new", config={CONFIG_KEY: self.config})
        self._use(run, owns=True)

    def _use(self, run, owns: bool) -> None:
        self.run, self.owns_run = run, owns
        self._attached_once = True
        self._row_step = None
        run.define_metric(STEP_KEY, hidden=True)
        run.define_metric(f"{PREFIX}.*", step_metric=STEP_KEY)
        if not owns:
            run.config.update({CONFIG_KEY: self.config}, allow_val_change=True)
        unsent, self._unsent = self._unsent, []
        self._send(unsent)
        if self.alerts:
            self._table_dirty = True
            self._write_summary()

    # -- alerts -------------------------------------------------------------------------------
    def _take_alerts(self) -> None:
        new = False
        while self._inbox:
            a = self._inbox.popleft()
            new = True
            self.alerts.append(a)
            self._counts[Severity(a.severity)] += 1
            row = self._row(int(a.step))
            for sev, n in self._counts.items():
                row[f"{PREFIX}.alerts/{sev.value}"] = n
            self._send(self.plan.add(a))
        if new:
            self._table_dirty = True
            self._write_summary()

    def _send(self, messages: list[Message]) -> None:
        if not messages:
            return
        if self.run is None:
            self._unsent += messages
            return
        for m in messages:
            try:
                self.run.alert(title=m.title, text=m.text, wait_duration=1,
                               level=getattr(self._wandb.AlertLevel, m.level))
            except Exception as e:
                # no notification integration, say; the table and charts still work
                self._warn("alert", f"wandb.alert failed ({type(e).__name__}: {e})")

    def alert_table(self):
        rows = [[int(a.step), int(a.rank), a.detector, Severity(a.severity).value, a.module,
                 a.tensor, a.stat, float(a.value), float(a.threshold), a.message, a.capture]
                for a in self.alerts]
        return self._wandb.Table(columns=ALERT_COLUMNS, data=rows)

    def _write_summary(self) -> None:
        # the summary is written as it changes: a run killed later still holds the table
        if self.run is None or _finished(self.run):
            return
        data: dict[str, Any] = {DROPPED_KEY: self.dropped}
        if self._table_dirty:
            data[TABLE_KEY] = self.alert_table()
            data.update({f"{PREFIX}.alerts/{s.value}": n for s, n in self._counts.items()})
        try:
            self.run.summary.update(data)
            self._table_dirty = False
        except Exception as e:
            self._warn("summary", f"W&B summary update failed ({type(e).__name__}: {e})")

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("stabilitywatch: wandb sink: %s", msg)


def _finished(run) -> bool:
    # a finished run's `step` waits 30 s for an answer that never comes
    return bool(getattr(run, "_is_finished", False))
