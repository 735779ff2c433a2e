import math
import sys

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from stabilitywatch.alert import Alert, Severity  # noqa: E402
from stabilitywatch.sinks import TensorBoardSink  # noqa: E402


def record(step, module, tensor, **stats):
    return {"schema": 1, "step": step, "rank": 0, "world_size": 1, "module": module,
            "tensor": tensor, "stats": stats}


def load(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_and_alert_text_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in range(3):
        sink.log([record(step, "layers.0", "output", absmax=float(step + 1), numel=10.0),
                  record(step, "", "loss", absmax=float("nan") if step == 2 else 0.5)])
    alert = Alert(step=2, detector="nonfinite", severity=Severity.CRITICAL, module="",
                  tensor="loss", stat="nan", value=1.0, threshold=0.0, message="loss is NaN")
    sink.alert(alert)
    sink.flush()
    sink.close()
    sink.close()

    acc = load(tmp_path / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert tags == {"stabilitywatch/layers.0/output/absmax", "stabilitywatch/model/loss/absmax"}
    out = acc.Scalars("stabilitywatch/layers.0/output/absmax")
    assert [(e.step, e.value) for e in out] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    loss = acc.Scalars("stabilitywatch/model/loss/absmax")
    assert [e.value for e in loss[:2]] == [0.5, 0.5] and math.isnan(loss[2].value)
    (text,) = acc.Tensors("stabilitywatch/alerts/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == alert.line()


def test_other_ranks_get_their_own_directory(tmp_path):
    sink = TensorBoardSink(tmp_path, stats_keys=("mean",), rank=3)
    sink.log([record(5, "fc", "grad", mean=0.125, absmax=9.0)])
    sink.close()
    acc = load(tmp_path / "tensorboard" / "rank3")
    assert acc.Tags()["scalars"] == ["stabilitywatch/fc/grad/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("stabilitywatch/fc/grad/mean")] == [(5, 0.125)]


def test_missing_tensorboard_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install stabilitywatch\[tensorboard\]"):
        TensorBoardSink(tmp_path)


def _frames(sink, steps=3):
    for step in range(steps):
        sink.log([record(step, f"blocks.{i}", "output", absmax=float(step + i), std=0.5 * i,
                         mean=-1.0 * step) for i in range(4)]
                 + [record(step, "", "loss", absmax=float("inf") if step == 1 else 2.0)])
    sink.alert(Alert(step=1, detector="nonfinite", severity=Severity.CRITICAL, module="",
                     tensor="loss", stat="posinf", value=1.0, threshold=0.0, message="inf"))
    sink.close()


def _everything(log_dir):
    acc = load(log_dir)
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = [(t.step, t.tensor_proto.string_val[0].decode())
             for t in acc.Tensors("stabilitywatch/alerts/text_summary")]
    return scalars, texts


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
    want[0]["stabilitywatch/x/output/absmax"] = [(0, 1.0)]
    assert got[1] == want[1] and len(got[1]) == 1
    assert got[0].keys() == want[0].keys()
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
    sink = TensorBoardSink(tmp_path / "a", stats_keys=("mean",))
    sink.log([record(1, "fc", "grad", mean=0.25)])
    assert sink._child is None and sink._writer is not None
    sink.close()
    monkeypatch.undo()
    from stabilitywatch.sinks import tensorboard_sink
    fake = tmp_path / "fake_writer.py"
    fake.write_text("print('error 0 ImportError: no module named tensorboard', flush=True)\n")
    monkeypatch.setattr(tensorboard_sink, "_WRITER", str(fake))
    sink = TensorBoardSink(tmp_path / "b", stats_keys=("mean",))
    sink.log([record(2, "fc", "grad", mean=0.5)])
    assert sink._child is None and sink._writer is not None
    sink.close()
    for d, step, v in (("a", 1, 0.25), ("b", 2, 0.5)):
        acc = load(tmp_path / d / "tensorboard")
        assert [(e.step, e.value) for e in acc.Scalars("stabilitywatch/fc/grad/mean")] == [(step, v)]


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
        assert len(sink._pending) == 1
    finally:
        sink._child._lock.release()
    sink.log([record(1, "x", "output", absmax=2.0)])   # hands it over
    sink.close()
    (text,) = load(tmp_path / "tensorboard").Tensors("stabilitywatch/alerts/text_summary")
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
    sink = TensorBoardSink(tmp_path / "d", stats_keys=("mean",))
    sink.log([record(2, "fc", "grad", mean=0.5)])
    assert sink._child is None and sink._writer is not None
    sink.close()
    (proc,) = started
    assert proc.poll() is not None, "the writer process was left running"
    acc = load(tmp_path / "d" / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("stabilitywatch/fc/grad/mean")] == [(2, 0.5)]
