"""SinkRunner: fans records and alerts out to sinks on one background thread.

Training never waits for stats (a full queue drops them, counted), waits at most a few seconds
for an alert, and never sees a sink's exception: a failing sink is switched off with one warning.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..alert import Alert
from .base import Sink

log = logging.getLogger("stabilitywatch")

ALERT_PUT_TIMEOUT = 5.0
_LOG, _ALERT, _FLUSH, _STOP = "log", "alert", "flush", "stop"


class SinkRunner:
    def __init__(self, sinks: list[Sink], queue_size: int = 1024):
        self.sinks = list(sinks)
        self._dead: set[int] = set()          # indices of sinks switched off
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(queue_size)))
        self._dropped = 0
        self._warned_drop = False
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stabilitywatch-sinks",
                                        daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Stats records dropped because the queue was full."""
        return self._dropped

    @property
    def failed(self) -> list[str]:
        """Names of the sinks that were switched off."""
        return [_name(self.sinks[i]) for i in sorted(self._dead)]

    # caller side ---------------------------------------------------------------------------
    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        try:
            self._queue.put_nowait((_LOG, records))
        except queue.Full:
            self._dropped += len(records)
            if not self._warned_drop:
                self._warned_drop = True
                log.warning("stabilitywatch: sink queue full, dropped %d stats records so far "
                            "(sinks slower than training); alerts are never dropped",
                            self._dropped)

    def alert(self, alert: Alert) -> None:
        if self._closed:
            return
        try:
            self._queue.put((_ALERT, alert), timeout=ALERT_PUT_TIMEOUT)
        except queue.Full:
            # The worker is stuck in a slow sink: deliver here rather than lose the alert. This
            # may run a sink on two threads at once, which beats blocking training on a lock.
            self._deliver(_ALERT, alert)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far reached the sinks, then flush them. Returns False
        when that did not happen within timeout seconds."""
        if self._closed:
            return False
        done = threading.Event()
        try:
            self._queue.put((_FLUSH, done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drain the queue, close every sink, stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put((_STOP, None), timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("stabilitywatch: sinks did not finish within %.0f s; giving up on them",
                        timeout)

    def __enter__(self) -> "SinkRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # worker side ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, payload = self._queue.get()
            try:
                if kind == _STOP:
                    self._close_sinks()
                    return
                if kind == _FLUSH:
                    self._deliver(_FLUSH, None)
                    payload.set()
                else:
                    self._deliver(kind, payload)
            finally:
                self._queue.task_done()

    def _deliver(self, kind: str, payload: Any) -> None:
        for i, sink in enumerate(self.sinks):
            if i in self._dead:
                continue
            try:
                if kind == _LOG:
                    sink.log(payload)
                elif kind == _ALERT:
                    sink.alert(payload)
                else:
                    sink.flush()
            except Exception as e:
                self._switch_off(i, e)

    def _close_sinks(self) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                sink.close()
            except Exception as e:
                if i in self._dead:
                    # Already reported; closing is only a courtesy to free its resources.
                    log.debug("stabilitywatch: closing failed sink %r: %r", _name(sink), e)
                else:
                    self._switch_off(i, e)

    def _switch_off(self, i: int, e: BaseException) -> None:
        # Locked: an alert delivered on the caller's thread may fail at the same time.
        with self._lock:
            if i in self._dead:
                return
            self._dead.add(i)
        log.warning("stabilitywatch: sink '%s' failed (%s: %s); switched off, training goes on",
                    _name(self.sinks[i]), type(e).__name__, e)


def _name(sink: Any) -> str:
    return str(getattr(sink, "name", None) or type(sink).__name__)
