"""One sink's thread and queues (the SinkRunner holds one per sink).

Alerts wait in a queue of their own, unbounded (alerts are few; one is never dropped for lack of
room) and go to the sink before statistics; batches of statistics records wait in a queue of
`sinks.queue_size` batches, and a batch that finds it full is dropped (counted). The training thread
only appends under `cond`, which is never held while the sink runs.

A sink is switched off when a call raises anything (BaseException included: SystemExit ends a
thread silently) or, as the runner's watchdog sees, does not return within the runner's timeout;
from then on it is never called again (a timed-out one not even close()) and everything it had
not written is counted.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from .base import Sink

log = logging.getLogger("stabilitywatch")

OK, FAILED, TIMED_OUT, ABANDONED = "ok", "failed", "timed_out", "abandoned"


class Worker:
    def __init__(self, sink: Sink, name: str, queue_size: int, on_done: Callable[[], None]):
        self.sink, self.name = sink, name
        self.queue_size = max(1, int(queue_size))
        self.cond = threading.Condition()
        self.alerts: collections.deque = collections.deque()
        self.stats: collections.deque = collections.deque()
        self.flushes: list = []            # [alerts_in, stats_in, Event]: served in order
        self.alerts_in = self.alerts_done = 0
        self.stats_in = self.stats_done = 0
        self.stopping = False
        self.done = False                  # closed, switched off or abandoned: nothing to wait for
        self.state = OK
        self.error: Optional[str] = None
        self.call: Optional[tuple] = None  # (method, started, alerts, records) while the sink runs
        self.dropped = 0                   # stats records dropped: its queue was full
        self.lost_alerts = self.lost_records = 0
        self.warned_full = False
        self._on_done = on_done
        self.thread = threading.Thread(target=self._run, name=f"stabilitywatch-sink-{name}",
                                       daemon=True)
        self.thread.start()

    # -- the training thread's side (never waits for the sink) --------------------------------
    def put_alert(self, alert: Any) -> None:
        with self.cond:
            if self.state != OK or self.stopping:
                self.lost_alerts += self.state != OK
                return
            self.alerts.append(alert)
            self.alerts_in += 1
            self.cond.notify()

    def put_records(self, records: list) -> bool:
        """True when the queue was full and this is the first batch dropped (warn once)."""
        with self.cond:
            if self.state != OK or self.stopping:
                self.lost_records += len(records) if self.state != OK else 0
                return False
            if len(self.stats) >= self.queue_size:
                self.dropped += len(records)
                first, self.warned_full = not self.warned_full, True
                return first
            self.stats.append(records)
            self.stats_in += 1
            self.cond.notify()
            return False

    def request_flush(self) -> Optional[threading.Event]:
        with self.cond:
            if self.state != OK or self.stopping:
                return None
            done = threading.Event()
            self.flushes.append([self.alerts_in, self.stats_in, done])
            self.cond.notify()
            return done

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def overdue(self, now: float, timeout: float) -> Optional[tuple]:
        """The call the sink has been stuck in for more than timeout seconds (close() is bounded
        by the runner's close deadline instead)."""
        call = self.call
        if call is None or call[0] == "close" or now - call[1] <= timeout:
            return None
        return call

    def switch_off(self, state: str, error: str, stuck_in: Optional[tuple] = None) -> bool:
        """Count what it had not written and stop handing it anything. False when it was off
        already, or (stuck_in given) that call has returned meanwhile."""
        with self.cond:
            if self.state != OK or (stuck_in is not None and self.call is not stuck_in):
                return False
            self._off(state, error)
        self._on_done()
        return True

    # -- the sink's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    job = self._next()
                    while job is None:
                        self.cond.wait()
                        job = self._next()
                    if job[0] == "exit":
                        return
                    n_alerts = 1 if job[0] == "alert" else 0
                    n_records = len(job[1]) if job[0] == "log" else 0
                    self.call = (job[0], time.monotonic(), n_alerts, n_records)
                if not self._call(job):
                    return
        finally:
            with self.cond:
                self.done = True
            self._on_done()

    def _next(self) -> Optional[tuple]:
        if self.state != OK:
            return ("exit",)
        if self.flushes and self.flushes[0][0] <= self.alerts_done \
                and self.flushes[0][1] <= self.stats_done:
            return ("flush",)
        if self.alerts:
            return ("alert", self.alerts.popleft())
        if self.stats:
            return ("log", self.stats.popleft())
        if self.stopping:
            return ("close",)
        return None

    def _call(self, job: tuple) -> bool:
        method = job[0]
        try:
            if method == "alert":
                self.sink.alert(job[1])
            elif method == "log":
                self.sink.log(job[1])
            elif method == "flush":
                self.sink.flush()
            else:
                self.sink.close()
        except BaseException as e:  # noqa: B902 (SystemExit would end this thread silently)
            return self._failed(method, e)
        with self.cond:
            self.call = None
            if self.state != OK:       # timed out meanwhile: it stays off
                return False
            if method == "alert":
                self.alerts_done += 1
            elif method == "log":
                self.stats_done += 1
            elif method == "flush":
                while self.flushes and self.flushes[0][0] <= self.alerts_done \
                        and self.flushes[0][1] <= self.stats_done:
                    self.flushes.pop(0)[2].set()
            else:
                return False           # closed: the thread ends
        return True

    def _failed(self, method: str, e: BaseException) -> bool:
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        with self.cond:
            first = self.state == OK
            if first:
                self._off(FAILED, error, done=False)
            self.call = None
        if first:
            log.warning("stabilitywatch: sink '%s' failed (%s); switched off, training goes on",
                        self.name, error)
            with self.cond:
                self.done = True   # close() may return now: the warning is out
            self._on_done()
            if method != "close":
                self._courtesy_close()
        return False

    def _courtesy_close(self) -> None:
        # frees what the failed sink holds (files, processes); it has been reported already
        try:
            self.sink.close()
        except BaseException as e:  # noqa: B902
            log.debug("stabilitywatch: closing failed sink %r: %r", self.name, e)

    def _off(self, state: str, error: str, done: bool = True) -> None:
        # under self.cond: what was queued, and the call in flight, are not (known to be) written
        self.state, self.error = state, error
        self.done = self.done or done
        if self.call is not None and self.call[0] in ("alert", "log"):
            self.lost_alerts += self.call[2]
            self.lost_records += self.call[3]
        self.lost_alerts += len(self.alerts)
        self.lost_records += sum(len(r) for r in self.stats)
        self.alerts.clear()
        self.stats.clear()
        for _, _, event in self.flushes:
            event.set()
        self.flushes.clear()
        self.cond.notify_all()

    def counts(self) -> dict[str, Any]:
        # a sink still stuck in a call is not asked (its own lock may be held there)
        own = _own_counts(self.sink) if self.state in (OK, FAILED) else {}
        return {"state": self.state, "error": self.error,
                "alerts_lost": self.lost_alerts + own.get("alerts", 0),
                "records_lost": self.lost_records + own.get("records", 0),
                "records_dropped": self.dropped,
                **({"note": own["note"]} if own.get("note") else {})}


def _own_counts(sink: Sink) -> dict:
    try:
        got = sink.lost()
        return {k: got[k] for k in ("alerts", "records", "note") if k in got}
    except Exception:  # a plug-in sink's lost() is its own business: the runner's counts stand
        return {}
