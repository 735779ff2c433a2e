"""JSONL sink: run_dir/alerts.jsonl and run_dir/stats.jsonl, one JSON object per line.

Alerts are written and fsync'd here, as they arrive. Stats lines are formatted and written by a
writer process (jsonl_writer.py, started on the first record): formatting a frame's floats on
the sink's thread held the GIL that the training thread needs for every PyTorch call. Where the
process cannot start, or with JsonlSink(process=False), they are written here.
"""
from __future__ import annotations

import os
from typing import Any, Optional, TextIO

from ..alert import Alert
from ..stats.derive import DerivedRow
from . import jsonl_lines
from .base import Sink
from .child import HERE, Child

_WRITER = os.path.join(HERE, "jsonl_writer.py")
_dumps = jsonl_lines.dumps
_clean_record = jsonl_lines.clean_record


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, world_size: int = 1,
                 process: bool = True):
        self.run_dir = os.fspath(run_dir)
        self.rank = int(rank)
        self.world_size = int(world_size)
        # Each rank writes its own files so that lines of different processes never interleave.
        suffix = "" if self.rank == 0 else f".rank{self.rank}"
        self.alerts_path = os.path.join(self.run_dir, f"alerts{suffix}.jsonl")
        self.stats_path = os.path.join(self.run_dir, f"stats{suffix}.jsonl")
        self._alerts: Optional[TextIO] = None
        self._stats: Optional[TextIO] = None   # stats written here (no writer process)
        self._writer: Optional[Child] = None
        self._process = process
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
        if self._writer is None and self._stats is None:
            self._start()
        if self._writer is not None:
            self._writer.send(("lines", to_parts(records)))
            return
        # One write per batch: a failure leaves earlier lines intact.
        self._stats.write(encode_records(records))
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
        if self._writer is not None:
            self._writer.request(("flush",))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        files, self._alerts, self._stats = (self._alerts, self._stats), None, None
        error = None
        if self._writer is not None:
            w, self._writer = self._writer, None
            try:
                w.request(("close",))
            except OSError as e:
                error = e
            finally:
                w.stop()
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

    # -- the writer process ------------------------------------------------------------------
    def _start(self) -> None:
        self._open(self.stats_path).close()  # the directory, and a partial last line ended
        if self._process:
            self._writer = Child.start(["-I", _WRITER, self.stats_path], "JSONL writer process")
        if self._writer is None:
            self._stats = self._open(self.stats_path)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def to_parts(records: list[dict[str, Any]]) -> list:
    """The records as jsonl_lines parts: plain values only (for the writer process). Records
    whose stats are rows of one frame's shared columns (stats.derive.DerivedRow) become one
    ("frame", table, heads, rows) part."""
    parts: list = []
    i = 0
    while i < len(records):
        stats = records[i].get("stats")
        j = i
        if isinstance(stats, DerivedRow):
            table = stats.table
            while (j < len(records) and isinstance(records[j].get("stats"), DerivedRow)
                   and records[j]["stats"].table is table):
                j += 1
        if j - i < 2:
            r = records[i]
            parts.append(("record", {**r, "stats": dict(r.get("stats", {}))}))
            i += 1
            continue
        group = records[i:j]
        parts.append(("frame", table, [{k: v for k, v in r.items() if k != "stats"}
                                       for r in group], [r["stats"].index for r in group]))
        i = j
    return parts


def encode_records(records: list[dict[str, Any]]) -> str:
    """JSON lines for stats records (what the writer process writes for them)."""
    return jsonl_lines.encode_parts(to_parts(records))
