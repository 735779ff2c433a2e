"""TensorBoard sink: the dashboards' scalars and exponent histograms (sinks/dashboard.py),
alerts as text, the Config as text and hparams; written by a process of the sink's own
(tb_writer.py).

Alerts: one text per (severity, step) under `sw.alerts/<severity>`, holding every alert of that
step and severity. TensorBoard shows one text per tag and step, so one event per alert would
hide all but one of a step's alerts.
"""
from __future__ import annotations

import json
import os
import threading
import time
from array import array
from typing import Any, Optional

from ..alert import Alert, Severity
from .base import Sink
from .child import HERE, Child
from .dashboard import PREFIX, Dashboard, flat_config, run_config

_WRITER = os.path.join(HERE, "tb_writer.py")
ALERT_TAG = f"{PREFIX}.alerts"
CONFIG_TAG = f"{PREFIX}.config"
_ORDER = (Severity.CRITICAL, Severity.WARNING, Severity.INFO)


class TensorBoardSink(Sink):
    """process=True (the default): the events are made and written by a writer process of the
    sink's own (tb_writer.py, started on the first record or alert); this side only hands it
    tag numbers and float arrays. Where it cannot start, or with process=False, the same writer
    code runs on the sink's thread (~125 ms of GIL per 608-row frame)."""
    name = "tensorboard"

    def __init__(self, run_dir: str | os.PathLike, config=None, rank: int = 0,
                 world_size: int = 1, process: bool = True,
                 dashboard: Optional[Dashboard] = None):
        try:
            import tensorboard.summary.writer.event_file_writer  # noqa: F401
        except ImportError as e:
            raise ImportError("TensorBoardSink needs tensorboard: "
                              "pip install stabilitywatch[tensorboard]") from e
        if dashboard is None:
            from ..config import Config
            dashboard = Dashboard.from_config(config if config is not None else Config())
        self.dashboard = dashboard
        self.rank = int(rank)
        self.config = run_config(config, self.rank, int(world_size))
        log_dir = os.path.join(os.fspath(run_dir), "tensorboard")
        if self.rank != 0:
            log_dir = os.path.join(log_dir, f"rank{self.rank}")
        self.log_dir = log_dir
        self._process = process
        self._child: Optional[Child] = None
        self._here = None                         # (handle, flush, close) in this process
        self._tags: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
        self._ntags = 0
        self._start_lock = threading.Lock()
        self._open: list[Alert] = []              # alerts of the step not yet written
        self._pending: list[tuple] = []           # text messages not yet handed over
        self._drain_lock = threading.Lock()
        self._closed = False

    def _start(self) -> None:
        # from the sink runner's thread only (log, flush, close): starting takes the writer's
        # imports, ~1 s
        with self._start_lock:
            if self._child is not None or self._here is not None:
                return
            if self._process:
                self._child = Child.start([_WRITER, self.log_dir], "TensorBoard writer process",
                                          handshake=True)
            if self._child is None:
                from .tb_writer import open_writer
                self._here = open_writer(self.log_dir)
            text = "```json\n" + json.dumps(self.config, indent=1, sort_keys=True) + "\n```"
            self._send([("text", CONFIG_TAG, text, 0, time.time()),
                        ("hparams", flat_config(self.config))])

    def _send(self, msgs: list[tuple], block: bool = True) -> bool:
        if self._child is not None:
            return self._child.send(*msgs, block=block)
        for m in msgs:
            self._here[0](m)
        return True

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        self._start()
        self._close_step()   # the step's alerts come before its records
        self._drain(block=True)
        new, by_step, hists = [], {}, {}
        dash = self.dashboard
        for r in records:
            key = (r["module"], r["tensor"])
            names, vals = dash.values(r)
            got = self._tags.get(key)
            if got is None or got[1] != names:  # this row's tags, numbered once
                nums = list(range(self._ntags, self._ntags + len(names)))
                self._ntags += len(names)
                got = self._tags[key] = (nums, names)
                new += names
            idx, arr = by_step.setdefault(int(r["step"]), (array("i"), array("d")))
            idx.extend(got[0])
            arr.extend(vals)
            h = dash.histogram(r)
            if h is not None:
                hists.setdefault(int(r["step"]), []).append(
                    (h[0], h[1], array("d", h[2].tolist()).tobytes()))
        msgs: list[tuple] = [("tags", new)] if new else []
        wall = time.time()
        msgs += [("scalars", step, wall, idx.tobytes(), vals.tobytes())
                 for step, (idx, vals) in by_step.items() if len(idx)]
        msgs += [("histos", step, wall, items) for step, items in hists.items()]
        if msgs:
            self._send(msgs)

    def alert(self, alert: Alert) -> None:
        # The runner may call this on the training thread, when its own thread is stuck (in this
        # sink, say, writing to a full pipe): never wait here. The alert is held and handed
        # over with its step's others, now if nobody else is sending, else by the next call.
        if self._closed:
            return
        if self._open and self._open[-1].step != alert.step:
            self._close_step()
        self._open.append(alert)
        self._drain(block=False)

    def _close_step(self) -> None:
        """The open step's alerts become one text per severity."""
        open_, self._open = self._open, []
        if not open_:
            return
        wall = time.time()
        for sev in _ORDER:
            lines = [a.line() for a in open_ if Severity(a.severity) is sev]
            if lines:
                text = "\n".join(f"* {line}" for line in lines)   # markdown: one item each
                self._pending.append(("text", f"{ALERT_TAG}/{sev.value}", text,
                                      int(open_[0].step), wall))

    def _drain(self, block: bool) -> None:
        if self._child is None and self._here is None:  # not started: log() will
            return
        if not self._drain_lock.acquire(blocking=block):
            return
        try:
            items = []
            while self._pending:
                items.append(self._pending.pop(0))
            if items and not self._send(items, block=block):
                self._pending[:0] = items   # the sender was busy: next time
        finally:
            self._drain_lock.release()

    def flush(self) -> None:
        if self._closed:
            return
        self._close_step()
        if self._pending:
            self._start()
        self._drain(block=True)
        if self._child is not None:
            self._child.request(("flush",))
        elif self._here is not None:
            self._here[1]()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._close_step()
            if self._pending:
                self._start()
            self._drain(block=True)
        finally:
            self._closed = True
            child, self._child = self._child, None
            if child is not None:
                try:
                    child.request(("close",))
                finally:
                    child.stop()
            elif self._here is not None:
                self._here[2]()
