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
