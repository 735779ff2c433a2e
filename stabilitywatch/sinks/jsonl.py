"""JSONL sink: run_dir/alerts.jsonl and run_dir/stats.jsonl, one JSON object per line."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, TextIO

import numpy as np

from ..alert import Alert, _json_float
from ..stats.derive import DerivedRow
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


def encode_records(records: list[dict[str, Any]]) -> str:
    """JSON lines for stats records. Records whose stats are rows of one frame's shared columns
    (stats.derive.DerivedRow) are encoded column by column: one float repr per value and one
    %-format per line, in C: about 2/3 of the CPU time of value by value through json, and the
    training thread, which needs the GIL to launch its kernels, waits far less for it
    (benchmarks/RESULTS.md, "Overhead ... session 3")."""
    lines: list[str] = []
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
            lines.append(_dumps(_clean_record(records[i])))
            i += 1
            continue
        group = records[i:j]
        body = _stats_objects(table, [r["stats"].index for r in group])
        for r, b in zip(group, body):
            head = _dumps({k: v for k, v in r.items() if k != "stats"})
            lines.append(f'{head[:-1]},"stats":{b}}}' if len(head) > 2 else f'{{"stats":{b}}}')
        i = j
    return "".join(line + "\n" for line in lines)


def _stats_objects(table: dict, rows: list[int]) -> list[str]:
    # one JSON object per row; the same values as _clean_record + json.dumps would write
    keys = list(table)
    template = "{" + ",".join(_dumps(k).replace("%", "%%") + ":%s" for k in keys) + "}"
    columns = []
    for k in keys:
        col = table[k]
        arr = np.asarray(col)
        if arr.dtype.kind in "fiub":  # numbers are written as floats, as _json_float does
            toks = list(map(float.__repr__, map(float, col)))
            if not np.isfinite(arr.astype(np.float64)).all():  # nan, inf, -inf: as strings
                toks = [t if math.isfinite(v) else f'"{t}"' for t, v in zip(toks, map(float, col))]
        else:
            toks = [_dumps(_json_float(v) if isinstance(v, float) else v) for v in col]
        columns.append(toks)
    by_row = list(zip(*columns)) if columns else [()] * (max(rows) + 1 if rows else 0)
    return [template % by_row[r] for r in rows]


def _clean_record(record: dict[str, Any]) -> dict[str, Any]:
    out = dict(record)
    out["stats"] = {k: _json_float(v) for k, v in record.get("stats", {}).items()}
    return out


def _dumps(obj: Any) -> str:
    # allow_nan=False: a stray non-finite float must fail loudly, never produce invalid JSON.
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))
