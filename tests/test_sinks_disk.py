"""Alerts before statistics when the disk fills: a real small filesystem (tmpfs, where mounting
is permitted) and a file-size limit (RLIMIT_FSIZE: EFBIG, everywhere on POSIX) under a real
Monitor; alerts.jsonl and run.json are kept, statistics are dropped and counted, every file
parses."""
import errno
import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest

from sink_scenarios import CountingSink, read_jsonl, sink_warnings, train
from stabilitywatch.sinks import JsonlSink
from stabilitywatch.sinks import jsonl as jsonl_module

HERE = os.path.dirname(os.path.abspath(__file__))


def check_run_dir(run_dir, alerts, records):
    """alerts (dicts, as mon.alerts wrote them) all on disk; stats.jsonl parses and holds only
    part of `records`; run.json counts exactly the rest."""
    on_disk = read_jsonl(os.path.join(run_dir, "alerts.jsonl"))
    assert on_disk == alerts
    stats = read_jsonl(os.path.join(run_dir, "stats.jsonl"))
    assert 0 < len(stats) < records
    with open(os.path.join(run_dir, "run.json")) as f:
        report = json.load(f)["sinks"]["jsonl"]
    assert report["state"] == "ok" and report["alerts_lost"] == 0
    assert report["records_lost"] == records - len(stats)
    assert "statistics stopped" in report["note"]
    return report


@pytest.fixture
def small_fs():
    d = tempfile.mkdtemp()
    # the alerts' reserve (256 KiB) and run.json fit; statistics fill the rest within ~20 steps
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=448k", "tmpfs", d],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        # lazy: a writer process of a failed test may still hold a file there
        subprocess.run(["umount", "-l", d], timeout=30)
        os.rmdir(d)


@pytest.mark.parametrize("process", [True, False], ids=["writer-process", "sink-thread"])
def test_full_filesystem_keeps_alerts_and_drops_statistics(small_fs, caplog, monkeypatch,
                                                           process):
    if not process:
        monkeypatch.setattr("sys.executable", "")   # no writer process can start
    counting = CountingSink()
    run_dir = os.path.join(small_fs, "run")
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        mon, _ = train(run_dir, ("jsonl", counting), steps=40, nan_from=30)
        mon.close()
    assert len(mon.alerts) == 10
    report = check_run_dir(run_dir, [a.to_dict() for a in mon.alerts], counting.records)
    assert "No space left on device" in report["note"]
    (warning,) = sink_warnings(caplog)
    assert warning.startswith("stabilitywatch: sink 'jsonl': cannot write") and \
        "No space left on device" in warning and "alerts go on" in warning


@pytest.mark.skipif(not hasattr(os, "fork"), reason="RLIMIT_FSIZE is POSIX")
def test_file_size_limit_keeps_alerts_and_drops_statistics(tmp_path):
    # EFBIG past the limit, for the monitor's process and its writer process alike; a process
    # of its own (~5 s, most of it importing torch): the limit holds for every file it writes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path])}
    r = subprocess.run([sys.executable, os.path.join(HERE, "sink_scenarios.py"), str(tmp_path),
                        str(48 * 1024)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    for where in ("process", "thread"):
        assert len(out[where]["alerts"]) == 20
        report = check_run_dir(tmp_path / where, out[where]["alerts"], out[where]["records"])
        assert "File too large" in report["note"]
    warnings = [line for line in r.stderr.splitlines() if "cannot write" in line]
    assert len(warnings) == 2 and all("statistics are dropped" in w for w in warnings)


def test_cut_last_line_is_cut_back_on_open(tmp_path):
    # a writer killed mid-line left half a JSON object: the files parse again, nothing appended
    # to the half line
    for name in ("stats.jsonl", "alerts.jsonl"):
        (tmp_path / name).write_text('{"step": 1}\n{"step": 2, "sta')
    sink = JsonlSink(tmp_path)
    sink.log([{"step": 3, "module": "m", "tensor": "output", "stats": {"absmax": 1.0}}])
    sink.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "stats.jsonl")] == [1, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / "alerts.jsonl")] == [1]


def test_alert_meeting_a_full_disk_is_counted_and_later_ones_written(tmp_path, monkeypatch,
                                                                     caplog):
    from stabilitywatch.alert import Alert, Severity
    from stabilitywatch.sinks import line_file

    class FullAfter(line_file.LineFile):
        """A disk with `room` bytes left: a write past it writes what fits, then fails (ENOSPC)."""
        room = 0

        def _write(self, data):
            if FullAfter.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = super()._write(data[:FullAfter.room])
            FullAfter.room -= n
            return n

    monkeypatch.setattr(jsonl_module.line_file, "LineFile", FullAfter)
    sink = JsonlSink(tmp_path, process=False)
    alert = lambda step: Alert(step=step, detector="nonfinite", severity=Severity.CRITICAL,  # noqa
                               module="fc", tensor="output", stat="nan", value=1.0,
                               threshold=0.0, message="x")
    FullAfter.room = 10 ** 6
    sink.alert(alert(1))
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        FullAfter.room = 30          # half of the next line fits
        sink.alert(alert(2))
        sink.alert(alert(3))
        FullAfter.room = 10 ** 6     # space again
        sink.alert(alert(4))
    sink.close()
    assert [a["step"] for a in read_jsonl(tmp_path / "alerts.jsonl")] == [1, 4]
    assert sink.lost() == {"alerts": 2, "records": 0}
    (warning,) = sink_warnings(caplog)
    assert "no space for" in warning and "step 2" in warning
