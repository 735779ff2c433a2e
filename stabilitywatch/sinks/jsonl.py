"""JSONL sink: run_dir/alerts.jsonl and run_dir/stats.jsonl, one JSON object per line."""
from __future__ import annotations

import json
import os
from typing import Any, Optional, TextIO

from ..alert import Alert, _json_float
from .base import Sink


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, world_size: int = 1):
        self.run_dir = os.fspath(run_dir)
        self.rank = int(rank)
        self.world_size = int(world_size)
        # Each rank writes its own files so that lines of different processes never interleave.
        suffix = "" if self.rank == 0 else f".rank{self.rank}"
        self.alerts_path = os.path.join(self.run_dir, f"alerts{suffix}.jsonl")
        self.stats_path = os.path.join(self.run_dir, f"stats{suffix}.jsonl")
        self._alerts: Optional[TextIO] = None
        self._stats: Optional[TextIO] = None
        self._closed = False

    def _open(self, path: str) -> TextIO:
        # Created lazily so that an unwritable run_dir fails inside the sink runner (one warning,
        # sink switched off) instead of in the user's code.
        os.makedirs(self.run_dir, exist_ok=True)
        f = open(path, "a", encoding="utf-8")
        if f.tell() > 0 and not _ends_with_newline(path):
            # a writer killed mid-line (a dead rank, a crash before a restart): end its partial
            # line so that every line written from now on parses
            f.write("\n")
            f.flush()
        return f

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        if self._stats is None:
            self._stats = self._open(self.stats_path)
        # One write per batch: a failure leaves earlier lines intact.
        self._stats.write("".join(_dumps(_clean_record(r)) + "\n" for r in records))
        self._stats.flush()

    def alert(self, alert: Alert) -> None:
        if self._closed:
            return
        if self._alerts is None:
            self._alerts = self._open(self.alerts_path)
        self._alerts.write(_dumps(alert.to_dict()) + "\n")
        # An alert may precede a crash of the training process: make it durable right away.
        self._alerts.flush()
        os.fsync(self._alerts.fileno())

    def flush(self) -> None:
        for f in (self._alerts, self._stats):
            if f is not None and not f.closed:
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        files, self._alerts, self._stats = (self._alerts, self._stats), None, None
        error = None
        for f in files:
            if f is None:
                continue
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                error = error or e
            finally:
                f.close()
        if error is not None:
            raise error


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _clean_record(record: dict[str, Any]) -> dict[str, Any]:
    out = dict(record)
    out["stats"] = {k: _json_float(v) for k, v in record.get("stats", {}).items()}
    return out


def _dumps(obj: Any) -> str:
    # allow_nan=False: a stray non-finite float must fail loudly, never produce invalid JSON.
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))
