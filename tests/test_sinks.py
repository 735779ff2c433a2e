import dataclasses
import errno
import json
import os
import logging
import threading
import time

import pytest
import torch

from stabilitywatch.alert import Alert, Severity
from stabilitywatch.sinks import ConsoleSink, JsonlSink, Sink, SinkRunner
from stabilitywatch.sinks import jsonl as jsonl_module

ALERT_KEYS = {"schema", "step", "rank", "detector", "severity", "module", "tensor", "stat",
              "value", "threshold", "message", "capture"}


def make_alert(step=7, severity=Severity.CRITICAL, value=float("nan"), threshold=0.0, **kw):
    fields = dict(step=step, detector="nonfinite", severity=severity, module="layers.0.mlp",
                  tensor="output", stat="nan", value=value, threshold=threshold,
                  message="NaN appeared here first")
    fields.update(kw)
    return Alert(**fields)


def make_record(step, module="layers.0", tensor="output", **stats):
    return {"schema": 1, "step": step, "rank": 0, "world_size": 1, "module": module,
            "tensor": tensor, "stats": stats or {"absmax": 1.5, "mean": 0.25}}


def read_jsonl(path):
    def reject(name):
        raise AssertionError(f"bare {name} in JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=reject) for line in f]


class RecordingSink(Sink):
    name = "recording"

    def __init__(self):
        self.records, self.alerts, self.flushes, self.closes = [], [], 0, 0

    def log(self, records):
        self.records.extend(records)

    def alert(self, alert):
        self.alerts.append(alert)

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closes += 1


class FailingSink(RecordingSink):
    name = "boom"

    def log(self, records):
        raise OSError(errno.EIO, "disk on fire")

    alert = log

    def close(self):
        raise RuntimeError("close fails too")


class GatedSink(RecordingSink):
    """log() blocks until the gate opens: a sink stuck on a slow network."""
    name = "gated"

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def log(self, records):
        self.entered.set()
        self.gate.wait(10)
        super().log(records)


def sink_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "stabilitywatch" and r.levelno == logging.WARNING]


def test_jsonl_alert_on_disk_after_short_flush(tmp_path):
    runner = SinkRunner([JsonlSink(tmp_path)])
    alert = make_alert(capture="captures/step7")
    runner.alert(alert)
    assert runner.flush(timeout=5)
    (line,) = read_jsonl(tmp_path / "alerts.jsonl")
    assert ALERT_KEYS <= set(line)
    assert line["step"] == 7 and line["severity"] == "critical" and line["detector"] == "nonfinite"
    assert line["module"] == "layers.0.mlp" and line["capture"] == "captures/step7"
    assert line["value"] == "nan" and line["threshold"] == 0.0
    runner.close()


def test_jsonl_alert_is_fsynced_as_it_arrives(tmp_path, monkeypatch):
    synced = []
    real_fsync = jsonl_module.os.fsync
    monkeypatch.setattr(jsonl_module.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    sink = JsonlSink(tmp_path)
    sink.alert(make_alert())
    assert len(synced) == 1
    assert len(read_jsonl(tmp_path / "alerts.jsonl")) == 1   # readable before close()
    sink.close()


def test_jsonl_stats_nonfinite_become_strings(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.log([make_record(3, absmax=float("inf"), mean=float("nan"), min=float("-inf"), std=2.0)])
    sink.log([make_record(4, module="", tensor="loss")])
    sink.close()
    first, second = read_jsonl(tmp_path / "stats.jsonl")
    assert first["stats"] == {"absmax": "inf", "mean": "nan", "min": "-inf", "std": 2.0}
    assert {"schema", "step", "rank", "world_size", "module", "tensor"} <= set(first)
    assert second["step"] == 4 and second["module"] == "" and second["tensor"] == "loss"


def test_jsonl_other_ranks_write_their_own_files(tmp_path):
    sink = JsonlSink(tmp_path / "new" / "dir", rank=2, world_size=4)
    sink.alert(make_alert(rank=2))
    sink.log([make_record(1)])
    sink.close()
    names = sorted(p.name for p in (tmp_path / "new" / "dir").iterdir())
    assert names == ["alerts.rank2.jsonl", "stats.rank2.jsonl"]


def test_failing_sink_switched_off_with_one_warning(caplog):
    good, bad = RecordingSink(), FailingSink()
    runner = SinkRunner([bad, good])
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        for step in range(5):
            runner.log([make_record(step)])
            runner.alert(make_alert(step=step))
        assert runner.flush(timeout=5)
        runner.close()       # the failed sink's close() raises too: must not escape or warn again
    assert sink_warnings(caplog) == [
        "stabilitywatch: sink 'boom' failed (OSError: [Errno 5] disk on fire); "
        "switched off, training goes on"]
    assert [r["step"] for r in good.records] == list(range(5))
    assert [a.step for a in good.alerts] == list(range(5))
    assert good.flushes == 1 and good.closes == 1
    assert runner.failed == ["boom"]


def test_slow_sink_does_not_block_log_and_alerts_are_not_dropped(caplog):
    slow, other = GatedSink(), RecordingSink()
    runner = SinkRunner([slow, other], queue_size=64)
    try:
        with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
            runner.log([make_record(0), make_record(0, tensor="grad")])
            assert slow.entered.wait(5)     # its thread is now stuck in the slow sink
            start = time.perf_counter()
            for step in range(1, 200):
                runner.log([make_record(step), make_record(step, tensor="grad")])
                time.sleep(0.0005)          # a training step's worth of GIL for other threads
            runner.alert(make_alert(step=999))
            assert time.perf_counter() - start < 1.0
            # the other sink has what it was given, without waiting for the slow one
            assert runner.flush(timeout=0.5) is False          # the slow sink holds it up
            report = runner.report()
            assert [a.step for a in other.alerts] == [999]
            assert len(other.records) + report["recording"]["records_dropped"] == 400
            assert report["gated"]["records_dropped"] >= 400 - 2 * 65
            slow.gate.set()
            runner.close()
    finally:
        slow.gate.set()
    assert len(slow.records) + runner.report()["gated"]["records_dropped"] == 400
    assert [a.step for a in slow.alerts] == [999]    # alerts are never dropped
    warnings = sink_warnings(caplog)
    assert warnings[0].startswith("stabilitywatch: sink 'gated' is slower than training") and \
        "stats records are dropped" in warnings[0]
    assert len(warnings) == 1 + (report["recording"]["records_dropped"] > 0)


class HungSink(RecordingSink):
    """log() does not return (for 20 s, the test's bound), alert() works."""
    name = "hung"

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def log(self, records):
        self.gate.wait(20)


def test_log_and_alert_never_wait_for_a_hung_sink(caplog):
    hung, other = HungSink(), RecordingSink()
    runner = SinkRunner([hung, other], queue_size=4, timeout=0.3, close_timeout=1.0)
    calls = []
    try:
        with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
            end = time.monotonic() + 0.6        # past the hung sink's timeout
            step = 0
            while time.monotonic() < end or step < 100:
                for call in (lambda: runner.log([make_record(step)] * 20),
                             lambda: runner.alert(make_alert(step=step))):
                    t0 = time.perf_counter()
                    call()
                    calls.append(time.perf_counter() - t0)
                step += 1
                time.sleep(0.002)
            assert runner.flush(timeout=5)
            runner.close()
    finally:
        hung.gate.set()
    calls.sort()
    assert calls[len(calls) // 2] < 0.001 and calls[-1] < 0.1, (calls[len(calls) // 2], calls[-1])
    assert [a.step for a in other.alerts] == list(range(step))
    # its queue filled first (one warning), then it was timed out (one more)
    full, timed_out = [w for w in sink_warnings(caplog) if "'hung'" in w]
    assert full.startswith("stabilitywatch: sink 'hung' is slower than training")
    assert timed_out.startswith("stabilitywatch: sink 'hung' timed out: log() did not return "
                                "within 0.3 s; switched off")
    report = runner.report()["hung"]
    assert report["state"] == "timed_out" and runner.failed == ["hung"]
    assert report["alerts_lost"] + len(hung.alerts) == step
    assert report["records_lost"] + report["records_dropped"] == 20 * step


class RaisingSink(RecordingSink):
    name = "raising"

    def __init__(self, exc, method):
        super().__init__()
        self.exc, self.method = exc, method
        for m in ("log", "alert", "flush", "close"):
            if m == method:
                setattr(self, m, self._raise)

    def _raise(self, *args):
        raise self.exc


@pytest.mark.parametrize("method", ["log", "alert", "flush", "close"])
@pytest.mark.parametrize("exc", [SystemExit(2), KeyboardInterrupt(), GeneratorExit()],
                         ids=["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_base_exception_in_a_sink_is_caught_and_reported(caplog, exc, method):
    bad, good = RaisingSink(exc, method), RecordingSink()
    runner = SinkRunner([bad, good], close_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        for step in range(3):
            runner.log([make_record(step)])
            runner.alert(make_alert(step=step))
        runner.flush(timeout=5)
        runner.close()
    name = type(exc).__name__
    said = f"{name}: {exc}" if str(exc) else name
    assert sink_warnings(caplog) == [f"stabilitywatch: sink 'raising' failed ({said}); "
                                     f"switched off, training goes on"]
    assert runner.failed == ["raising"] and runner.report()["raising"]["state"] == "failed"
    assert [a.step for a in good.alerts] == [0, 1, 2] and len(good.records) == 3
    assert good.closes == 1


def test_close_is_idempotent_and_later_calls_are_ignored():
    sink = RecordingSink()
    runner = SinkRunner([sink])
    runner.log([make_record(0)])
    runner.close()
    runner.close()
    runner.log([make_record(1)])
    runner.alert(make_alert())
    assert runner.flush(timeout=1) is False
    assert sink.closes == 1 and [r["step"] for r in sink.records] == [0] and sink.alerts == []


def test_jsonl_unwritable_run_dir_switches_off_with_one_warning(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("I am a file")
    other = RecordingSink()
    runner = SinkRunner([JsonlSink(not_a_dir), other])
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        runner.alert(make_alert(step=1))
        runner.log([make_record(1)])
        runner.alert(make_alert(step=2))
        runner.close()
    (warning,) = sink_warnings(caplog)
    assert warning.startswith("stabilitywatch: sink 'jsonl' failed (FileExistsError")
    assert [a.step for a in other.alerts] == [1, 2] and len(other.records) == 1
    assert not_a_dir.read_text() == "I am a file"


def disk_full(f):
    """The open line_file.LineFile f is on a full disk from now on."""
    def write(data):
        raise OSError(errno.ENOSPC, "No space left on device")
    f._write = write


def test_jsonl_disk_full_keeps_alerts_and_drops_stats(tmp_path, caplog):
    # stats written by the sink's thread (process=False); the writer process: a later test
    sink = JsonlSink(tmp_path, process=False)
    runner = SinkRunner([sink])
    runner.alert(make_alert(step=1))
    runner.alert(make_alert(step=2))
    runner.log([make_record(1), make_record(2)])
    assert runner.flush(timeout=5)
    disk_full(sink._stats)
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        runner.log([make_record(3), make_record(3, tensor="grad")])
        runner.alert(make_alert(step=3))     # alerts still have room
        runner.log([make_record(4)])
        assert runner.flush(timeout=5)
        disk_full(sink._alerts)
        runner.alert(make_alert(step=4))
        runner.alert(make_alert(step=5))
        runner.close()
    stats_warning, alerts_warning = sink_warnings(caplog)
    assert stats_warning.startswith("stabilitywatch: sink 'jsonl': cannot write") and \
        "No space left on device" in stats_warning and "alerts go on" in stats_warning
    assert "no space for" in alerts_warning and "step 4" in alerts_warning
    assert [a["step"] for a in read_jsonl(tmp_path / "alerts.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / "stats.jsonl")] == [1, 2]
    report = runner.report()["jsonl"]
    assert report["state"] == "ok" and report["alerts_lost"] == 2 and report["records_lost"] == 3


def test_console_sink_levels_and_threshold(caplog):
    with caplog.at_level(logging.DEBUG, logger="stabilitywatch"):
        sink = ConsoleSink()
        sink.log([make_record(0)])
        for sev in Severity:
            sink.alert(make_alert(severity=sev, value=3.0))
        ConsoleSink(min_severity="warning").alert(make_alert(severity=Severity.INFO))
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "stabilitywatch"]
    assert [lvl for lvl, _ in got] == [logging.INFO, logging.WARNING, logging.ERROR]
    assert got[2][1] == make_alert(severity=Severity.CRITICAL, value=3.0).line()
    with pytest.raises(ValueError, match="min_severity"):
        ConsoleSink(min_severity="loud")



def test_jsonl_frame_records_encode_exactly_as_one_by_one():
    # the column-wise encoder writes, byte for byte, what json.dumps of each cleaned record writes
    import numpy as np
    from stabilitywatch.sinks.jsonl import _clean_record, _dumps, encode_records
    from stabilitywatch.stats.derive import derive_many
    from stabilitywatch.stats.layout import Stat, init_row
    from stabilitywatch.stats.reference import reference_row

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) * 10 ** k for k in range(-3, 4)]
    xs[2][5] = float("nan")
    xs[4][:] = float("inf")
    rows = np.stack([reference_row(x).cpu().numpy() for x in xs] + [init_row()])
    rows[1, Stat.SUM] = -0.0
    stats = derive_many(rows, [1.0] * len(rows))
    base = {"schema": 1, "step": 7, "rank": 0, "world_size": 1}
    recs = [{**base, "module": f'm"{i}%s\u00e9', "tensor": "output", "stats": s}
            for i, s in enumerate(stats)]
    recs.insert(3, {**base, "module": "", "tensor": "grad_norm", "stats": {"l2norm": 1.5}})
    recs.append({**base, "module": "x", "tensor": "shadow", "stats": {"err": float("nan")}})
    want = "".join(_dumps(_clean_record(r)) + "\n" for r in recs)
    assert encode_records(recs) == want
    assert [json.loads(line)["module"] for line in want.splitlines()] == [r["module"] for r in recs]


def test_jsonl_column_encoder_takes_ints_bools_and_specials_like_one_by_one():
    from stabilitywatch.sinks.jsonl import _clean_record, _dumps, encode_records
    from stabilitywatch.stats.derive import DerivedRow

    table = {"n": [3, 0, -7], "flag": [True, False, True],
             "x": [float("nan"), -0.0, float("-inf")], "y": [1e300, 2.5e-320, float("inf")]}
    recs = [{"step": 1, "module": f"m{i}", "tensor": "output", "stats": DerivedRow(table, i)}
            for i in range(3)]
    assert encode_records(recs) == "".join(_dumps(_clean_record(r)) + "\n" for r in recs)


def test_jsonl_writer_process_disk_full_drops_stats_and_keeps_alerts(tmp_path, caplog):
    # the stats file on a full disk (/dev/full: every write fails with ENOSPC), written by the
    # writer process: one warning naming the problem, alerts still written, nothing raised
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    (tmp_path / "stats.jsonl").symlink_to("/dev/full")
    sink = JsonlSink(tmp_path)
    runner = SinkRunner([sink])
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        runner.alert(make_alert(step=1))
        runner.log([make_record(1)])
        runner.flush(timeout=10)
        runner.alert(make_alert(step=2))
        runner.log([make_record(2), make_record(2, tensor="grad")])
        runner.close()
    (warning,) = sink_warnings(caplog)
    assert "No space left on device" in warning and warning.startswith(
        "stabilitywatch: sink 'jsonl': cannot write")
    assert [a["step"] for a in read_jsonl(tmp_path / "alerts.jsonl")] == [1, 2]
    assert sink.lost()["records"] == 3 and runner.failed == []


def test_jsonl_stats_are_formatted_by_the_writer_process(tmp_path, monkeypatch):
    # the training process never formats a stats line: the same file either way
    from stabilitywatch.sinks import jsonl_lines

    recs = [make_record(s, absmax=float(s), mean=float("nan")) for s in range(3)]
    local = JsonlSink(tmp_path / "here", process=False)
    local.log(recs)
    local.close()
    monkeypatch.setattr(jsonl_lines, "encode_parts", lambda parts: 1 / 0)
    sink = JsonlSink(tmp_path / "there")
    sink.log(recs)
    assert sink._writer is not None and sink._writer.proc.poll() is None
    sink.flush()
    writer = sink._writer.proc
    sink.close()
    assert writer.returncode == 0
    assert (tmp_path / "there" / "stats.jsonl").read_text() == \
        (tmp_path / "here" / "stats.jsonl").read_text()


def test_jsonl_writer_process_ends_with_the_training_process(tmp_path):
    # a sink never closed (a crash): the writer sees its input end, keeps what came, exits
    sink = JsonlSink(tmp_path)
    sink.log([make_record(5)])
    writer = sink._writer.proc
    writer.stdin.close()
    assert writer.wait(timeout=30) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "stats.jsonl")] == [5]


def test_jsonl_writes_from_its_thread_where_no_python_can_be_started(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.executable", "")
    sink = JsonlSink(tmp_path)
    sink.log([make_record(9)])
    assert sink._writer is None
    sink.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "stats.jsonl")] == [9]


def test_config_takes_sink_instances_beside_names():
    import stabilitywatch as sw

    mine = RecordingSink()
    cfg = sw.Config(sinks=["jsonl", "console", mine])
    assert cfg.sinks.use == ("jsonl", "console", mine) and cfg.sinks.use[2] is mine
    assert cfg.replace(every=3).sinks.use[2] is mine       # frozen, replace keeps the instance
    assert cfg == sw.Config(sinks=("jsonl", "console", mine))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sinks = ()


@pytest.mark.parametrize("sinks, match", [
    (("jsonl", object()), r"Config.sinks must hold sink names .* got <object object"),
    ((RecordingSink,), r"Config.sinks: RecordingSink is a Sink class; pass an instance"),
    (("jsonl", 3), r"Config.sinks must hold sink names"),
    (("jsonl", "prometheus"), r"Config.sinks: unknown sink 'prometheus'"),
    (("jsonl", "jsonl"), r"Config.sinks: 'jsonl' appears twice"),
], ids=["object", "class", "int", "unknown-name", "twice"])
def test_config_refuses_what_is_not_a_sink(sinks, match):
    import stabilitywatch as sw

    with pytest.raises(ValueError, match=match):
        sw.Config(sinks=sinks)
    mine = RecordingSink()
    with pytest.raises(ValueError, match="appears twice"):
        sw.Config(sinks=(mine, "jsonl", mine))     # one sink on two threads


@pytest.mark.parametrize("field", ["timeout", "close_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_config_sink_timeouts_are_positive_seconds(field, value):
    import stabilitywatch as sw

    with pytest.raises(ValueError, match=f"Config.sinks.{field} must be a positive number of "
                                         f"seconds"):
        sw.Config(sinks={field: value})
    assert getattr(sw.Config(sinks={field: 0.25}).sinks, field) == 0.25


def test_jsonl_stuck_writer_process_costs_stats_not_alerts(tmp_path, monkeypatch, caplog):
    # the writer process stops taking input (SIGSTOP: a hung disk, a debugger): after
    # send_timeout the sink gives up its statistics (counted) and goes on writing alerts
    import signal

    from stabilitywatch.sinks import child

    monkeypatch.setattr(child.Child, "send_timeout", 0.5)
    sink = JsonlSink(tmp_path)
    runner = SinkRunner([sink], timeout=5.0)
    runner.log([make_record(0)])
    assert runner.flush(timeout=10)
    pid = sink._writer.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
            big = [make_record(1, module=f"m{i}") for i in range(20000)]   # > the pipe's 1 MiB
            runner.log(big)
            runner.alert(make_alert(step=1))
            runner.log([make_record(2)])
            assert runner.flush(timeout=10)
            runner.alert(make_alert(step=2))
            runner.close()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    (warning,) = sink_warnings(caplog)
    assert "took no input for 0.5 s" in warning and "alerts go on" in warning
    assert [a["step"] for a in read_jsonl(tmp_path / "alerts.jsonl")] == [1, 2]
    stats = read_jsonl(tmp_path / "stats.jsonl")
    report = runner.report()["jsonl"]
    assert report["state"] == "ok" and report["alerts_lost"] == 0
    assert len(stats) + report["records_lost"] == 20002
