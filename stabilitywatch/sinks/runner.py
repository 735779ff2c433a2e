"""SinkRunner: fans statistics records and alerts out to sinks, each on a thread of its own.

What it guarantees (README "Sinks"):
- log() and alert() never wait for a sink: they append to each sink's queues (worker.py) under a
  lock that is never held while a sink runs, so no sink can stall training or starve another.
- Alerts are never dropped for lack of queue space; a batch of statistics records that finds a
  sink's queue (queue_size batches) full is dropped for that sink, counted, one warning.
- A sink call (log, alert, flush) that does not return within `timeout` seconds, or that raises
  anything, BaseException included, switches that sink off with one warning naming it.
- close() takes at most `close_timeout` seconds in all; a sink not done by then is abandoned,
  one warning naming it.
- report(): per sink, its state and what it did not write, for run.json.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from ..alert import Alert
from .base import Sink
from .console import ConsoleSink
from .worker import ABANDONED, OK, TIMED_OUT, Worker

log = logging.getLogger("stabilitywatch")

SINK_TIMEOUT = 10.0         # seconds a log/alert/flush call may take (Config.sinks.timeout)
CLOSE_TIMEOUT = 30.0        # seconds close() may take in all (Config.sinks.close_timeout)


class SinkRunner:
    def __init__(self, sinks: list[Sink], queue_size: int = 1024,
                 timeout: float = SINK_TIMEOUT, close_timeout: float = CLOSE_TIMEOUT):
        self.sinks = list(sinks)
        self.timeout = float(timeout)
        self.close_timeout = float(close_timeout)
        self._closed = False
        self._lock = threading.Lock()
        self._changed = threading.Condition()   # a worker finished or was switched off
        self._workers = [Worker(s, n, queue_size, self._wake)
                         for s, n in zip(self.sinks, _names(self.sinks))]
        # the workers whose sink writes statistics: the console's log() is a no-op, so it is
        # handed no records (its thread is not woken for each frame's)
        self._loggers = [w for w in self._workers if type(w.sink).log is not ConsoleSink.log]

    @property
    def dropped(self) -> int:
        """Stats records dropped because a sink's queue was full (summed over sinks)."""
        return sum(w.dropped for w in self._workers)

    @property
    def failed(self) -> list[str]:
        """Names of the sinks that were switched off (failed, timed out or abandoned)."""
        return [w.name for w in self._workers if w.state != OK]

    def report(self) -> dict[str, dict[str, Any]]:
        """Per sink name: state ("ok", "failed", "timed_out", "abandoned"), error, and counts:
        alerts_lost / records_lost (handed to the sink and not written: it was switched off, or
        said so itself, e.g. statistics dropped on a full disk), records_dropped (its queue was
        full)."""
        self._watch()
        return {w.name: w.counts() for w in self._workers}

    # -- the training thread's side -----------------------------------------------------------
    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        self._watch()
        for w in self._loggers:
            if w.put_records(records):
                log.warning("stabilitywatch: sink '%s' is slower than training: its queue is "
                            "full, so stats records are dropped for it (counted in run.json); "
                            "alerts are never dropped", w.name)

    def alert(self, alert: Alert) -> None:
        if self._closed:
            return
        self._watch()
        for w in self._workers:
            w.put_alert(alert)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far reached the sinks that are on, then flush them.
        False when that did not happen within timeout seconds (or the runner is closed)."""
        if self._closed:
            return False
        deadline = time.monotonic() + timeout
        for w, done in [(w, w.request_flush()) for w in self._workers]:
            while done is not None and not done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                done.wait(min(left, self._next_check(w)))
                self._watch()
        return True

    def close(self, timeout: Optional[float] = None) -> None:
        """Write what is queued, close every sink, all within close_timeout seconds (or
        timeout); sinks not done by then are abandoned with one warning each. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        limit = self.close_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        for w in self._workers:
            w.stop()
        with self._changed:
            while True:
                self._watch()
                pending = [w for w in self._workers if not w.done]
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    break
                self._changed.wait(min([left] + [self._next_check(w) for w in pending]))
        for w in pending:
            why = f"did not finish within {limit:g} s of close()"
            if w.switch_off(ABANDONED, why):
                c = w.counts()
                log.warning("stabilitywatch: sink '%s' %s; abandoned (%d alerts and %d stats "
                            "records not written, counted in run.json)", w.name, why,
                            c["alerts_lost"], c["records_lost"])

    def __enter__(self) -> "SinkRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the watchdog (runs on the caller's thread: log, alert, flush, close, report) ----------
    def _watch(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            call = w.overdue(now, self.timeout)
            if call is None:
                continue
            why = f"{call[0]}() did not return within {self.timeout:g} s"
            if w.switch_off(TIMED_OUT, why, stuck_in=call):
                c = w.counts()
                log.warning("stabilitywatch: sink '%s' timed out: %s; switched off and never "
                            "called again, training goes on (%d alerts and %d stats records it "
                            "had not written are counted in run.json)", w.name, why,
                            c["alerts_lost"], c["records_lost"])

    def _next_check(self, w: Worker) -> float:
        # how long until w's call in flight (if any) is overdue
        call = w.call
        if call is None or call[0] == "close":
            return self.timeout
        return max(0.001, call[1] + self.timeout - time.monotonic() + 0.001)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


def _names(sinks: list[Sink]) -> list[str]:
    # report() keys: two sinks of one name are told apart by a suffix
    names: list[str] = []
    for s in sinks:
        base = str(getattr(s, "name", None) or type(s).__name__)
        name, k = base, 2
        while name in names:
            name, k = f"{base}#{k}", k + 1
        names.append(name)
    return names
