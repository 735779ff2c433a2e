"""WandbSink, run offline and read back from the run's .wandb file (never the network)."""
import json
import math
import os
import sys

import pytest

wandb = pytest.importorskip("wandb")

from stabilitywatch.alert import Alert, Severity  # noqa: E402
from stabilitywatch.sinks import WandbSink  # noqa: E402
from stabilitywatch.sinks.wandb_sink import ALERT_COLUMNS  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import wandb_reader  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb.run is None
    yield
    if wandb.run is not None:
        wandb.run.finish()


def record(step, module, tensor, **stats):
    return {"schema": 1, "step": step, "rank": 0, "world_size": 1, "module": module,
            "tensor": tensor, "stats": stats}


def make_alert(step, severity=Severity.WARNING, **kw):
    fields = dict(step=step, detector="overflow", severity=severity, module="layers.1",
                  tensor="grad", stat="e4m3_overflow_frac", value=0.25, threshold=0.01,
                  message="too many values above 448")
    fields.update(kw)
    return Alert(**fields)


def read_run(run_dir):
    (path,) = wandb_reader.find_run_files(str(run_dir))
    return wandb_reader.read_finished_run(path), os.path.dirname(path)


def test_offline_run_reads_back(tmp_path):
    sink = WandbSink(tmp_path, run_name="sw-test", alerts_per_minute=2)
    assert sink.owns_run and wandb.run is None      # our own run does not become wandb.run
    now = [1000.0]
    sink._clock = lambda: now[0]
    for step in (0, 10, 20):
        sink.log([record(step, "layers.0", "output", absmax=step + 0.5, numel=64.0, rms=0.1),
                  record(step, "", "loss", absmax=float("nan") if step == 20 else 2.0)])
    alerts = [make_alert(10), make_alert(20, Severity.CRITICAL, value=float("inf")),
              make_alert(21, Severity.INFO), make_alert(22)]
    for a in alerts:
        sink.alert(a)
    now[0] += 61.0
    last = make_alert(30, Severity.CRITICAL, detector="nonfinite", capture="captures/step30")
    sink.alert(last)
    sink.close()
    sink.close()

    records, run_files = read_run(tmp_path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header" and "run" in kinds and kinds[-1] == "exit"   # finished on close

    metrics = wandb_reader.records_of(records, "metric")
    assert any(m.name == "stabilitywatch/step" for m in metrics)
    assert any(m.glob_name == "stabilitywatch/*" and m.step_metric == "stabilitywatch/step"
               for m in metrics)

    rows = wandb_reader.history_rows(records)
    stat_rows = [r for r in rows if "stabilitywatch/layers.0/output/absmax" in r]
    assert [r["stabilitywatch/step"] for r in stat_rows] == [0, 10, 20]
    assert [r["stabilitywatch/layers.0/output/absmax"] for r in stat_rows] == [0.5, 10.5, 20.5]
    assert [r["stabilitywatch/layers.0/output/rms"] for r in stat_rows] == [0.1] * 3
    assert all("stabilitywatch/layers.0/output/numel" not in r for r in rows)  # not in stats_keys
    assert all("stabilitywatch/layers.0/output/mean" not in r for r in rows)   # missing: skipped
    loss = [r["stabilitywatch/model/loss/absmax"] for r in stat_rows]
    assert loss[:2] == [2.0, 2.0] and math.isnan(loss[2])

    counts = [(r["stabilitywatch/step"], r["stabilitywatch/alerts/count"])
              for r in rows if "stabilitywatch/alerts/count" in r]
    assert counts == [(10, 1), (20, 2), (21, 3), (22, 4), (30, 5)]

    # Offline, wandb.alert() does not fail: the alert is a record in the .wandb file.
    sent = wandb_reader.records_of(records, "alert")
    assert [a.level for a in sent] == ["WARN", "ERROR", "ERROR"]
    assert [a.text.splitlines()[0] for a in sent] == [alerts[0].line(), alerts[1].line(),
                                                      last.line()]
    assert "2 earlier alert(s) held back" in sent[2].text
    assert all(len(a.title) < 64 and a.title.startswith("stabilitywatch: ") for a in sent)

    (table_row,) = [r for r in rows if "stabilitywatch/alerts" in r]
    table = table_row["stabilitywatch/alerts"]
    assert table["_type"] == "table-file" and table["nrows"] == 5 and table["ncols"] == 11
    with open(os.path.join(run_files, "files", table["path"])) as f:
        content = json.load(f)
    assert content["columns"] == ALERT_COLUMNS
    assert [row[0] for row in content["data"]] == [10, 20, 21, 22, 30]
    assert content["data"][1][3] == "critical" and content["data"][1][7] == math.inf
    assert content["data"][4][2] == "nonfinite" and content["data"][4][10] == "captures/step30"
    assert content["data"][0][10] is None


def test_uses_the_users_run_and_leaves_it_open(tmp_path):
    run = wandb.init(project="user-project", dir=str(tmp_path))
    run.log({"loss": 3.0})
    sink = WandbSink(tmp_path / "ignored")
    assert sink.run is run and not sink.owns_run
    sink.log([record(4, "fc", "weight", absmax=7.0)])
    sink.close()
    run.log({"loss": 2.0})          # still open after the sink closed
    run.finish()

    records, _ = read_run(tmp_path)
    rows = wandb_reader.history_rows(records)
    assert [r["loss"] for r in rows if "loss" in r] == [3.0, 2.0]
    assert [r["stabilitywatch/fc/weight/absmax"] for r in rows
            if "stabilitywatch/fc/weight/absmax" in r] == [7.0]
    assert not (tmp_path / "ignored").exists()


def test_failing_wandb_alert_does_not_break_the_sink(tmp_path, monkeypatch):
    sink = WandbSink(tmp_path)

    def broken(**kwargs):
        raise RuntimeError("alerts unavailable")

    monkeypatch.setattr(sink.run, "alert", broken)
    sink.alert(make_alert(1))
    sink.alert(make_alert(2))
    sink.log([record(2, "fc", "grad", absmax=1.0)])
    assert len(sink.alerts) == 2
    sink.close()
    rows = wandb_reader.history_rows(read_run(tmp_path)[0])
    assert any("stabilitywatch/fc/grad/absmax" in r for r in rows)
    assert [r["stabilitywatch/alerts"]["nrows"] for r in rows if "stabilitywatch/alerts" in r] == [2]


def test_missing_wandb_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install stabilitywatch\[wandb\]"):
        WandbSink(tmp_path)


def test_reader_reassembles_records_split_across_blocks(tmp_path):
    sink = WandbSink(tmp_path)
    # One history row of ~100 KiB: it must be split into FIRST/MIDDLE/LAST chunks.
    sink.log([record(1, f"blocks.{i}.attention.output_projection", "output", absmax=float(i))
              for i in range(1500)])
    sink.close()
    records, _ = read_run(tmp_path)
    (path,) = wandb_reader.find_run_files(str(tmp_path))
    assert os.path.getsize(path) > 2 * wandb_reader.BLOCK_SIZE
    kinds = [k for k, _ in wandb_reader.iter_chunks(path)]
    assert kinds.count(wandb_reader.FIRST) >= 1 and kinds.count(wandb_reader.MIDDLE) >= 1
    (row,) = [r for r in wandb_reader.history_rows(records)
              if "stabilitywatch/step" in r and r["stabilitywatch/step"] == 1
              and "stabilitywatch/alerts" not in r]
    values = [row[f"stabilitywatch/blocks.{i}.attention.output_projection/output/absmax"]
              for i in range(1500)]
    assert values == [float(i) for i in range(1500)]
