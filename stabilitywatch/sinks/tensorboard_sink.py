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
        self._closed = False

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed:
            return
        for r in records:
            prefix = f"stabilitywatch/{r['module'] or 'model'}/{r['tensor']}"
            stats = r.get("stats", {})
            for key in self.stats_keys:
                if key in stats:
                    self._writer.add_scalar(f"{prefix}/{key}", float(stats[key]), int(r["step"]))

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
