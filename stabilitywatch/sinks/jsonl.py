"""JSONL sink: run_dir/alerts.jsonl and run_dir/stats.jsonl, one JSON object per line.

Alerts are written and fsync'd here, as they arrive. Stats lines are formatted and written by a
writer process (jsonl_writer.py, started on the first record): formatting a frame's floats on
the sink's thread held the GIL that the training thread needs for every PyTorch call. Where the
process cannot start, or with JsonlSink(process=False), they are written here.

Alerts come before statistics: alerts.jsonl is created before stats.jsonl and keeps a reserve of
disk space (line_file.py); when statistics cannot be written (a full disk, a dead writer), they
are dropped from then on, counted (lost()) with one warning, and alerts go on. A full disk costs
only the alert that met it (counted); other errors on alerts.jsonl raise (the runner switches
the sink off). Both files always end on a complete line.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ..alert import Alert
import numpy as np

from ..stats.derive import NAMES, DerivedRow
from . import jsonl_lines, line_file
from .base import Sink
from .child import HERE, Child

log = logging.getLogger("stabilitywatch")

_WRITER = os.path.join(HERE, "jsonl_writer.py")
_dumps = jsonl_lines.dumps
_clean_record = jsonl_lines.clean_record
ALERT_RESERVE = 256 * 1024   # bytes kept allocated past the end of alerts.jsonl (~600 alerts)


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, world_size: int = 1,
                 process: bool = True, alert_reserve: Optional[int] = None):
        self.run_dir = os.fspath(run_dir)
        self.rank = int(rank)
        self.world_size = int(world_size)
        # Each rank writes its own files so that lines of different processes never interleave.
        suffix = "" if self.rank == 0 else f".rank{self.rank}"
        self.alerts_path = os.path.join(self.run_dir, f"alerts{suffix}.jsonl")
        self.stats_path = os.path.join(self.run_dir, f"stats{suffix}.jsonl")
        self.alert_reserve = ALERT_RESERVE if alert_reserve is None else int(alert_reserve)
        self._alerts: Optional[line_file.LineFile] = None
        self._stats: Optional[line_file.LineFile] = None   # stats written here (no writer process)
        self._writer: Optional[Child] = None
        self._process = process
        self._closed = False
        self._stats_error: Optional[str] = None   # why stats are no longer written
        self._sent = 0                            # records handed to the writer process
        self.alerts_lost = 0
        self.records_lost = 0
        self._warned_alerts = False

    def _alerts_file(self) -> line_file.LineFile:
        # Created lazily (on the first alert or record) so that an unwritable run_dir fails
        # inside the sink runner (one warning, sink switched off), not in the user's code, and
        # a rank that never writes creates nothing.
        if self._alerts is None:
            os.makedirs(self.run_dir, exist_ok=True)
            self._alerts = line_file.LineFile(self.alerts_path, reserve=self.alert_reserve)
        return self._alerts

    def log(self, records: list[dict[str, Any]]) -> None:
        if self._closed or not records:
            return
        try:
            self._alerts_file()   # before any statistics: alerts.jsonl and its reserve first
        except OSError as e:
            if e.errno not in line_file.FULL:
                raise
        if self._stats_error is not None:
            self.records_lost += len(records)
            return
        try:
            if self._writer is None and self._stats is None:
                self._start()
            if self._writer is not None:
                self._writer.send(("lines", to_parts(records)))
                self._sent += len(records)
            else:
                # One write per batch: a failure cuts it back, earlier lines stay intact.
                self._stats.append(encode_records(records).encode("utf-8"))
        except OSError as e:
            self._stop_stats(e, len(records))

    def alert(self, alert: Alert) -> None:
        if self._closed:
            return
        line = (_dumps(alert.to_dict()) + "\n").encode("utf-8")
        try:
            # An alert may precede a crash of the training process: durable right away.
            self._alerts_file().append(line, sync=True)
        except OSError as e:
            if e.errno not in line_file.FULL:
                raise
            self.alerts_lost += 1
            if not self._warned_alerts:
                self._warned_alerts = True
                log.warning("stabilitywatch: sink 'jsonl': no space for %s (%s); the alert of "
                            "step %s is not written (counted in run.json), later ones are tried "
                            "as they come", self.alerts_path, e, alert.step)

    def lost(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alerts": self.alerts_lost, "records": self.records_lost}
        if self._stats_error is not None:
            out["note"] = f"statistics stopped: {self._stats_error}"
        return out

    def flush(self) -> None:
        # each alert was fsync'd as it was written
        self._sync_stats("flush")

    def close(self) -> None:
        if self._closed:
            return
        self._sync_stats("close")
        self._closed = True
        f, self._alerts = self._alerts, None
        if self._stats is not None:
            self._stats.close()
            self._stats = None
        if f is not None:
            f.close()   # gives back the reserve

    # -- statistics: the writer process, or this thread --------------------------------------
    def _start(self) -> None:
        # the file made here, and a cut last line repaired, before the writer opens it
        line_file.LineFile(self.stats_path).close()
        if self._process:
            self._writer = Child.start(["-I", _WRITER, self.stats_path], "JSONL writer process")
        if self._writer is None:
            self._stats = line_file.LineFile(self.stats_path)

    def _sync_stats(self, what: str) -> None:
        try:
            if self._writer is not None:
                self._writer.request((what,))
                if what == "close":
                    w, self._writer = self._writer, None
                    w.stop()
            elif self._stats is not None:
                self._stats.sync()
        except OSError as e:
            self._stop_stats(e, 0)

    def _stop_stats(self, e: OSError, n: int) -> None:
        """Statistics cannot be written (full disk, writer gone): dropped from now on, counted,
        one warning; alerts go on."""
        lost = n
        if self._writer is not None:
            w, self._writer = self._writer, None
            # sent and not confirmed written ("ok N" / "note N": N records written): lost
            written = w.report
            lost += self._sent - (int(written) if written and written.isdigit() else 0)
            w.stop(kill=True)
            line_file.repair(self.stats_path)   # a writer killed mid-line
        if self._stats is not None:
            f, self._stats = self._stats, None
            f.close()
        self.records_lost += lost
        if self._stats_error is None:
            self._stats_error = f"{type(e).__name__}: {e}"
            log.warning("stabilitywatch: sink 'jsonl': cannot write %s (%s); statistics are "
                        "dropped from now on (counted in run.json), alerts go on",
                        self.stats_path, self._stats_error)


def to_parts(records: list[dict[str, Any]]) -> list:
    """The records as jsonl_lines parts: plain values only (for the writer process). Records
    whose stats are rows of one frame's shared columns (stats.derive.DerivedRow) become one
    part: ("frame64", names, the columns' float64 bytes, heads, rows) where the frame kept
    its columns as arrays (the writer process makes the Python floats, not this thread), else
    ("frame", table, heads, rows)."""
    parts: list = []
    i = 0
    while i < len(records):
        stats = records[i].get("stats")
        j = i
        if isinstance(stats, DerivedRow):
            shared = stats.columns
            while (j < len(records) and isinstance(records[j].get("stats"), DerivedRow)
                   and records[j]["stats"].columns is shared):
                j += 1
        if j - i < 2:
            r = records[i]
            stats = r.get("stats", {})
            parts.append(("record", {**r, "stats": stats.to_dict() if isinstance(stats, DerivedRow)
                                     else dict(stats)}))
            i += 1
            continue
        group = records[i:j]
        heads = [r.copy() for r in group]   # the records less their stats, in key order
        for h in heads:
            del h["stats"]
        rows = [r["stats"].index for r in group]
        arrays = stats.arrays
        if arrays is not None:
            blob = np.stack([arrays[k] for k in NAMES]).astype(np.float64, copy=False).tobytes()
            parts.append(("frame64", NAMES, blob, heads, rows))
        else:
            parts.append(("frame", stats.table, heads, rows))
        i = j
    return parts


def encode_records(records: list[dict[str, Any]]) -> str:
    """JSON lines for stats records (what the writer process writes for them)."""
    return jsonl_lines.encode_parts(to_parts(records))
