"""TensorBoard sink: scalars per (module, tensor role, statistic) and alerts as text."""
from __future__ import annotations

import os
from typing import Any, Iterable

from ..alert import Alert
from .base import Sink

DEFAULT_STATS_KEYS = (
    "absmax", "mean", "std", "rms", "nan", "posinf", "neginf",
    "e4m3_overflow_frac", "e4m3_underflow_frac", "e5m2_overflow_frac", "e5m2_underflow_frac",
    "fp16_overflow_frac", "fp16_underflow_frac", "l2norm",
)


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: str | os.PathLike, stats_keys: Iterable[str] = DEFAULT_STATS_KEYS,
                 rank: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardSink needs tensorboard: "
                              "pip install stabilitywatch[tensorboard]") from e
        self.rank = int(rank)
        self.stats_keys = tuple(stats_keys)
        log_dir = os.path.join(os.fspath(run_dir), "tensorboard")
        if self.rank != 0:
            log_dir = os.path.join(log_dir, f"rank{self.rank}")
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)
        from tensorboard.compat.proto.summary_pb2 import Summary
        self._summary, self._value = Summary, Summary.Value
        self._closed = False

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed:
            return
        # one Summary per step holding every value: add_scalar per value made an event each and
        # took ~0.8 s for a 608-row frame (benchmarks/bench_frame.py --latency tensorboard)
        by_step: dict = {}
        for r in records:
            prefix = f"stabilitywatch/{r['module'] or 'model'}/{r['tensor']}"
            stats = r.get("stats", {})
            values = by_step.setdefault(int(r["step"]), [])
            for key in self.stats_keys:
                if key in stats:
                    values.append(self._value(tag=f"{prefix}/{key}", simple_value=float(stats[key])))
        for step, values in by_step.items():
            if values:
                self._writer._get_file_writer().add_summary(self._summary(value=values), step)

    def alert(self, alert: Alert) -> None:
        if not self._closed:
            self._writer.add_text("stabilitywatch/alerts", alert.line(), int(alert.step))

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
