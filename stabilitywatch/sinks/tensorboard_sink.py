"""TensorBoard sink: scalars per (module, tensor role, statistic) and alerts as text, written by
a process of the sink's own (tb_writer.py)."""
from __future__ import annotations

import os
import threading
import time
from array import array
from typing import Any, Iterable, Optional

from ..alert import Alert
from .base import Sink
from .child import HERE, Child

_WRITER = os.path.join(HERE, "tb_writer.py")

DEFAULT_STATS_KEYS = (
    "absmax", "mean", "std", "rms", "nan", "posinf", "neginf",
    "e4m3_overflow_frac", "e4m3_underflow_frac", "e5m2_overflow_frac", "e5m2_underflow_frac",
    "fp16_overflow_frac", "fp16_underflow_frac", "l2norm",
)


class TensorBoardSink(Sink):
    """process=True (the default): the events are made and written by a writer process of the
    sink's own (tb_writer.py, started on the first record or alert); this side only hands it
    tag numbers and float arrays. Where it cannot start, or with process=False, a
    SummaryWriter on the sink's thread writes them (~125 ms of GIL per 608-row frame)."""
    name = "tensorboard"

    def __init__(self, run_dir: str | os.PathLike, stats_keys: Iterable[str] = DEFAULT_STATS_KEYS,
                 rank: int = 0, process: bool = True):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardSink needs tensorboard: "
                              "pip install stabilitywatch[tensorboard]") from e
        self._summary_writer = SummaryWriter
        self.rank = int(rank)
        self.stats_keys = tuple(stats_keys)
        log_dir = os.path.join(os.fspath(run_dir), "tensorboard")
        if self.rank != 0:
            log_dir = os.path.join(log_dir, f"rank{self.rank}")
        self.log_dir = log_dir
        self._process = process
        self._child: Optional[Child] = None
        self._writer = None                      # the in-process SummaryWriter
        self._tags: dict[tuple[str, str], list[int]] = {}   # (module, tensor) -> tag numbers
        self._ntags = 0
        self._start_lock = threading.Lock()
        self._pending: list[tuple[str, int, float]] = []   # alerts not yet handed over
        self._drain_lock = threading.Lock()
        self._closed = False

    def _start(self) -> None:
        # from the sink runner's thread only (log, flush, close): starting takes the writer's
        # imports, ~1 s
        with self._start_lock:
            if self._child is not None or self._writer is not None:
                return
            if self._process:
                self._child = Child.start([_WRITER, self.log_dir], "TensorBoard writer process",
                                          handshake=True)
            if self._child is None:
                self._writer = self._summary_writer(log_dir=self.log_dir)

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        self._start()
        self._drain(block=True)
        if self._child is None:
            return self._log_here(records)
        new, by_step = [], {}
        keys = self.stats_keys
        for r in records:
            key = (r["module"], r["tensor"])
            nums = self._tags.get(key)
            if nums is None:  # this row's tags, numbered once
                prefix = f"stabilitywatch/{r['module'] or 'model'}/{r['tensor']}"
                nums = self._tags[key] = list(range(self._ntags, self._ntags + len(keys)))
                self._ntags += len(keys)
                new += [f"{prefix}/{k}" for k in keys]
            idx, vals = by_step.setdefault(int(r["step"]), (array("i"), array("d")))
            stats = r.get("stats", {})
            for k, n in zip(keys, nums):
                v = stats.get(k)
                if v is not None:
                    idx.append(n)
                    vals.append(float(v))
        msgs = [("tags", new)] if new else []
        wall = time.time()
        msgs += [("scalars", step, wall, idx.tobytes(), vals.tobytes())
                 for step, (idx, vals) in by_step.items() if len(idx)]
        if msgs:
            self._child.send(*msgs)

    def _log_here(self, records: list[dict[str, Any]]) -> None:
        # one Summary per step holding every value: add_scalar per value made an event each and
        # took ~0.8 s for a 608-row frame (benchmarks/bench_frame.py --latency tensorboard)
        from tensorboard.compat.proto.summary_pb2 import Summary
        by_step: dict = {}
        for r in records:
            prefix = f"stabilitywatch/{r['module'] or 'model'}/{r['tensor']}"
            stats = r.get("stats", {})
            values = by_step.setdefault(int(r["step"]), [])
            for key in self.stats_keys:
                if key in stats:
                    values.append(Summary.Value(tag=f"{prefix}/{key}",
                                                simple_value=float(stats[key])))
        for step, values in by_step.items():
            if values:
                self._writer._get_file_writer().add_summary(Summary(value=values), step)

    def alert(self, alert: Alert) -> None:
        # The runner may call this on the training thread, when its own thread is stuck (in this
        # sink, say, writing to a full pipe): never wait here. The alert is queued and handed
        # over now if nobody else is sending, else by the next log, flush or close.
        if self._closed:
            return
        self._pending.append((alert.line(), int(alert.step), time.time()))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        if self._child is None and self._writer is None:  # not started: log() will
            return
        if not self._drain_lock.acquire(blocking=block):
            return
        try:
            items = []
            while self._pending:
                items.append(self._pending.pop(0))
            if not items:
                return
            if self._child is not None:
                msgs = [("text", "stabilitywatch/alerts", line, step, wall)
                        for line, step, wall in items]
                if not self._child.send(*msgs, block=block):
                    self._pending[:0] = items   # the sender was busy: next time
            else:
                for line, step, _ in items:
                    self._writer.add_text("stabilitywatch/alerts", line, step)
        finally:
            self._drain_lock.release()

    def flush(self) -> None:
        if self._closed:
            return
        if self._pending:
            self._start()
        self._drain(block=True)
        if self._child is not None:
            self._child.request(("flush",))
        elif self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        try:
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
            elif self._writer is not None:
                self._writer.close()
