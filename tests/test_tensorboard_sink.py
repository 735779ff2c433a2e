import json
import math
import sys

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from stabilitywatch.alert import Alert, Severity  # noqa: E402
from stabilitywatch.sinks import Dashboard, TensorBoardSink  # noqa: E402
from stabilitywatch.stats.derive import DerivedRow  # noqa: E402
from stabilitywatch.stats.layout import HIST_BINS  # noqa: E402


def record(step, module, tensor, **stats):
    return {"schema": 1, "step": step, "rank": 0, "world_size": 1, "module": module,
            "tensor": tensor, "stats": stats}


def _Hist(stats, hist):
    """A record's stats as the monitor makes them: shared columns plus the row's histogram."""
    return DerivedRow({k: [v] for k, v in stats.items()}, 0, np.asarray(hist)[None, :])


def make_alert(step, severity, **kw):
    fields = dict(step=step, detector="overflow", severity=severity, module="layers.1",
                  tensor="grad", stat="e4m3_overflow_frac", value=0.25, threshold=0.01,
                  message="too many values above 448")
    fields.update(kw)
    return Alert(**fields)


def load(log_dir):
    acc = EventAccumulator(str(log_dir),
                           size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def texts(acc, tag):
    return [(t.step, t.tensor_proto.string_val[0].decode()) for t in acc.Tensors(tag)]


def test_scalars_histograms_config_and_every_alert_read_back(tmp_path):
    from stabilitywatch import Config
    cfg = Config(formats={"output": "e4m3"}, every=5)
    sink = TensorBoardSink(tmp_path, config=cfg)
    hist = np.zeros(HIST_BINS)
    hist[[96 - 3, 96 + 2]] = [5, 7]            # exponents -3 and 2
    for step in range(3):
        stats = dict(absmax=float(step + 1), numel=10.0, rms=0.5, nan=0.0, posinf=float(step),
                     neginf=0.0, mean=3.0, e4m3_overflow_frac=0.1, e4m3_underflow_frac=0.2,
                     e5m2_overflow_frac=0.3)
        sink.log([{**record(step, "layers.0", "output"), "stats": _Hist(stats, hist)},
                  record(step, "layers.0", "grad.bias", absmax=1.0),
                  record(step, "", "loss", mean=float("nan") if step == 2 else 0.5, nan=0.0,
                         posinf=0.0, neginf=0.0, absmax=0.5)])
    # step 25: infos first, then warnings and criticals, as detectors may emit them
    alerts = ([make_alert(25, Severity.INFO, module=f"m{i}") for i in range(20)]
              + [make_alert(25, Severity.WARNING, module=f"w{i}") for i in range(3)]
              + [make_alert(25, Severity.CRITICAL, module=f"c{i}") for i in range(2)]
              + [make_alert(26, Severity.CRITICAL, module="late")])
    for a in alerts:
        sink.alert(a)
    sink.flush()
    sink.close()
    sink.close()

    acc = load(tmp_path / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert tags == {f"sw.output.{s}/layers.0" for s in ("absmax", "rms", "nonfinite",
                                                         "e4m3_overflow_frac",
                                                         "e4m3_underflow_frac")} | \
        {"sw.loss.mean/model", "sw.loss.nonfinite/model"}   # biases: not by default
    out = acc.Scalars("sw.output.absmax/layers.0")
    assert [(e.step, e.value) for e in out] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert [e.value for e in acc.Scalars("sw.output.nonfinite/layers.0")] == [0.0, 1.0, 2.0]
    loss = acc.Scalars("sw.loss.mean/model")
    assert [e.value for e in loss[:2]] == [0.5, 0.5] and math.isnan(loss[2].value)
    # the exponent histogram: bins [-3, -2) ... [2, 3), counts 5 and 7 at the ends
    (htag,) = acc.Tags()["histograms"]
    assert htag == "sw.output.exponents/layers.0"
    h = acc.Histograms(htag)
    assert [e.step for e in h] == [0, 1, 2]
    v = h[0].histogram_value
    assert v.min == -3 and v.max == 3 and v.num == 12
    assert list(v.bucket_limit) == [-2, -1, 0, 1, 2, 3] and list(v.bucket) == [5, 0, 0, 0, 0, 7]
    # every alert visible: one text per (severity, step), holding all of them
    got = {sev: texts(acc, f"sw.alerts/{sev}/text_summary") for sev in ("critical", "warning",
                                                                         "info")}
    assert [s for s, _ in got["critical"]] == [25, 26]
    assert [s for s, _ in got["warning"]] == [25] and [s for s, _ in got["info"]] == [25]
    lines = [ln[2:] for sev in got for _, t in got[sev] for ln in t.splitlines()]
    assert sorted(lines) == sorted(a.line() for a in alerts)
    # the Config, as text and hparams
    ((step, text),) = texts(acc, "sw.config/text_summary")
    cfg_json = json.loads(text.split("```json", 1)[1].rsplit("```", 1)[0])
    assert cfg_json["every"] == 5 and cfg_json["formats"] == {"output": "e4m3"}
    assert cfg_json["versions"]["stabilitywatch"] and cfg_json["world_size"] == 1
    hp = [t for t in acc.Tags()["tensors"] if t.startswith("_hparams_/")]
    assert hp == ["_hparams_/session_start_info"]
    meta = acc.SummaryMetadata("_hparams_/session_start_info")
    from tensorboard.plugins.hparams import plugin_data_pb2
    data = plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content)
    assert data.session_start_info.hparams["every"].number_value == 5
    assert data.session_start_info.hparams["formats.output"].string_value == "e4m3"


def test_other_ranks_get_their_own_directory(tmp_path):
    sink = TensorBoardSink(tmp_path, dashboard=Dashboard(("mean",)), rank=3)
    sink.log([record(5, "fc", "grad", mean=0.125, absmax=9.0)])
    sink.close()
    acc = load(tmp_path / "tensorboard" / "rank3")
    assert acc.Tags()["scalars"] == ["sw.grad.mean/fc"]
    assert [(e.step, e.value) for e in acc.Scalars("sw.grad.mean/fc")] == [(5, 0.125)]


def test_missing_tensorboard_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ImportError, match=r"pip install stabilitywatch\[tensorboard\]"):
        TensorBoardSink(tmp_path)


def _frames(sink, steps=3):
    for step in range(steps):
        sink.log([{**record(step, f"blocks.{i}", "output"), "stats": _Hist(
            dict(absmax=float(step + i), rms=0.5 * i, mean=-1.0 * step, nan=0.0, posinf=0.0,
                 neginf=float(i)), np.arange(HIST_BINS) % (i + 2))} for i in range(4)]
                 + [record(step, "", "loss", absmax=float("inf") if step == 1 else 2.0)])
    sink.alert(Alert(step=1, detector="nonfinite", severity=Severity.CRITICAL, module="",
                     tensor="loss", stat="posinf", value=1.0, threshold=0.0, message="inf"))
    sink.close()


def _everything(log_dir):
    acc = load(log_dir)
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    found = [(t.step, t.tensor_proto.string_val[0].decode())
             for t in acc.Tensors("sw.alerts/critical/text_summary")]
    found += texts(acc, "sw.config/text_summary")
    hists = {t: [(e.step, list(e.histogram_value.bucket)) for e in acc.Histograms(t)]
             for t in acc.Tags()["histograms"]}
    return scalars, found, hists


def test_writer_process_writes_what_the_thread_would(tmp_path):
    # the writer process (default) and the in-thread SummaryWriter give the same events
    here = TensorBoardSink(tmp_path / "here", process=False)
    there = TensorBoardSink(tmp_path / "there")
    there.log([record(0, "x", "output", absmax=1.0)])
    proc = there._child.proc
    assert proc.poll() is None and here._child is None
    _frames(here)
    there._tags.clear()  # numbering starts again: the writer must follow the new tag table
    _frames(there)
    assert proc.wait(timeout=30) == 0
    got, want = _everything(tmp_path / "there" / "tensorboard"), \
        _everything(tmp_path / "here" / "tensorboard")
    want[0]["sw.output.absmax/x"] = [(0, 1.0)]
    assert got[1] == want[1] and len(got[1]) == 2
    assert got[2] == want[2] and len(got[2]) == 4
    assert got[0].keys() == want[0].keys() and len(got[0]) == 4 * 3 + 1
    for tag, series in want[0].items():
        assert str(got[0][tag]) == str(series), tag   # str: inf and nan compare as text


def test_dead_writer_process_raises_from_log(tmp_path):
    # the sink runner switches a sink off on an exception: a writer that died must give one
    sink = TensorBoardSink(tmp_path)
    sink.log([record(0, "x", "output", absmax=1.0)])
    sink._child.proc.kill()
    sink._child.proc.wait()
    with pytest.raises(OSError, match="TensorBoard writer process"):
        for step in range(1, 50):  # the pipe may take a write or two before it breaks
            sink.log([record(step, f"y{step}", "output", absmax=1.0)])


def test_writes_in_process_where_the_writer_cannot_start(tmp_path, monkeypatch):
    # no Python to start (a frozen application), or a writer that says its imports failed
    monkeypatch.setattr("sys.executable", "")
    sink = TensorBoardSink(tmp_path / "a", dashboard=Dashboard(("mean",)))
    sink.log([record(1, "fc", "grad", mean=0.25)])
    assert sink._child is None and sink._here is not None
    sink.close()
    monkeypatch.undo()
    from stabilitywatch.sinks import tensorboard_sink
    fake = tmp_path / "fake_writer.py"
    fake.write_text("print('error 0 ImportError: no module named tensorboard', flush=True)\n")
    monkeypatch.setattr(tensorboard_sink, "_WRITER", str(fake))
    sink = TensorBoardSink(tmp_path / "b", dashboard=Dashboard(("mean",)))
    sink.log([record(2, "fc", "grad", mean=0.5)])
    assert sink._child is None and sink._here is not None
    sink.close()
    for d, step, v in (("a", 1, 0.25), ("b", 2, 0.5)):
        acc = load(tmp_path / d / "tensorboard")
        assert [(e.step, e.value) for e in acc.Scalars("sw.grad.mean/fc")] == [(step, v)]


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 100, 1023, 4096, 4097, 65537, 300001])
def test_numpy_crc32c_matches_tensorboards(n):
    # the writer process checksums large records with tb_crc: it must equal tensorboard's own
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c, masked_crc32c

    from stabilitywatch.sinks import tb_crc
    data = bytes((i * 2654435761 >> 7) & 0xFF for i in range(n))
    assert tb_crc.crc32c(data) == crc32c(data)
    assert tb_crc.masked_crc32c(data) == masked_crc32c(data)
    for blocks in (1, 7, 64):
        assert tb_crc.crc32c(data, blocks) == crc32c(data)
    assert tb_crc.crc32c(b"123456789") == 0xE3069283   # the CRC-32C check value


def test_alert_never_waits_for_a_busy_writer(tmp_path):
    # the runner delivers alerts on the training thread when its own thread is stuck, e.g. in
    # this sink writing to a full pipe: the alert must return at once and still arrive
    import threading
    import time as _time
    sink = TensorBoardSink(tmp_path)
    sink.log([record(0, "x", "output", absmax=1.0)])
    sink._child._lock.acquire()   # another thread is sending
    try:
        t0 = _time.perf_counter()
        done = threading.Event()
        threading.Thread(target=lambda: (sink.alert(Alert(
            step=3, detector="nonfinite", severity=Severity.CRITICAL, module="", tensor="loss",
            stat="nan", value=1.0, threshold=0.0, message="late")), done.set())).start()
        assert done.wait(5) and _time.perf_counter() - t0 < 5
        assert len(sink._open) + len(sink._pending) == 1   # held, not sent
    finally:
        sink._child._lock.release()
    sink.log([record(1, "x", "output", absmax=2.0)])   # hands it over
    sink.close()
    (text,) = load(tmp_path / "tensorboard").Tensors("sw.alerts/critical/text_summary")
    assert text.step == 3 and "late" in text.tensor_proto.string_val[0].decode()


@pytest.mark.parametrize("script", ["print('hello', flush=True)\nimport time\ntime.sleep(60)\n",
                                    "import time\ntime.sleep(60)\n",
                                    "import sys\nsys.exit(3)\n"],
                         ids=["chatty", "silent", "dies"])
def test_writer_that_cannot_talk_is_stopped_and_replaced(tmp_path, monkeypatch, script):
    # a writer that says something else, says nothing (past the timeout) or dies at start: the
    # sink writes in-process, and the process is not left running
    from stabilitywatch.sinks import child, tensorboard_sink
    fake = tmp_path / "fake_writer.py"
    fake.write_text(script)
    monkeypatch.setattr(tensorboard_sink, "_WRITER", str(fake))
    monkeypatch.setattr(child.Child, "timeout", 2.0)
    started = []
    real_init = child.Child.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        started.append(self.proc)

    monkeypatch.setattr(child.Child, "__init__", spy)
    sink = TensorBoardSink(tmp_path / "d", dashboard=Dashboard(("mean",)))
    sink.log([record(2, "fc", "grad", mean=0.5)])
    assert sink._child is None and sink._here is not None
    sink.close()
    (proc,) = started
    assert proc.poll() is not None, "the writer process was left running"
    acc = load(tmp_path / "d" / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("sw.grad.mean/fc")] == [(2, 0.5)]


def test_records_are_checksummed_by_a_crc32c_package_where_one_imports(monkeypatch):
    # tensorboard's record writer, pointed at the fastest CRC-32C there is; each choice must
    # give tensorboard's own checksums
    from tensorboard.summary.writer import record_writer

    from stabilitywatch.sinks import tb_writer
    data = bytes(range(256)) * 40
    want = record_writer.masked_crc32c(data)
    expected = ["google-crc32c", "crc32c", "numpy"]
    for name in expected:
        monkeypatch.setattr(record_writer, "masked_crc32c", record_writer.masked_crc32c)
        assert tb_writer.fast_crc(record_writer) == name
        assert record_writer.masked_crc32c(data) == want
        assert record_writer.masked_crc32c(b"abc") == tb_writer._masked(0x364B3FB7)
        monkeypatch.setitem(sys.modules, name.replace("-", "_"), None)   # next: without it
