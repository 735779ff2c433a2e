"""WandbSink, run offline and read back from the run's .wandb file (never the network)."""
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

wandb = pytest.importorskip("wandb")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.alert import Alert, Severity  # noqa: E402
from stabilitywatch.sinks import Dashboard, WandbSink  # noqa: E402
from stabilitywatch.sinks.wandb_sink import ALERT_COLUMNS, TABLE_KEY  # noqa: E402
from stabilitywatch.stats.derive import DerivedRow  # noqa: E402
from stabilitywatch.stats.layout import HIST_BINS  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import wandb_reader  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert wandb.run is None
    yield
    if wandb.run is not None:
        wandb.run.finish()


def record(step, module, tensor, hist=None, **stats):
    if hist is not None:
        stats = DerivedRow({k: [v] for k, v in stats.items()}, 0, np.asarray(hist)[None, :])
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


def last_summary(records, key):
    """The last value a summary record gave key (None if never)."""
    value = None
    for s in wandb_reader.records_of(records, "summary"):
        for item in s.update:
            if (item.key or "/".join(item.nested_key)) == key:
                value = json.loads(item.value_json)
    return value


def sw_config(records):
    """The run config's "stabilitywatch" entry, from wandb.init(config=) or config.update."""
    found = []
    for rec in records:
        kind = rec.WhichOneof("record_type")
        items = (rec.run.config.update if kind == "run" else
                 rec.config.update if kind == "config" else [])
        found += [json.loads(i.value_json) for i in items if i.key == "stabilitywatch"]
    assert found, "no stabilitywatch entry in the run config"
    return found[-1]


def table_rows(run_files, table):
    with open(os.path.join(run_files, "files", table["path"])) as f:
        content = json.load(f)
    assert content["columns"] == ALERT_COLUMNS
    return content["data"]


# -- the user's own metrics, in every order of wandb.init, watch and the first wandb.log ------
ORDERS = ["init-watch-log", "watch-init-log", "init-log-watch"]


@pytest.mark.parametrize("use_step", [True, False], ids=["step=", "no-step"])
@pytest.mark.parametrize("order", ORDERS)
def test_users_metrics_all_there_in_every_init_order(tmp_path, order, use_step):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    cfg = sw.Config(sinks=("wandb", "jsonl"), every=2, warmup=0, formats={"output": "e4m3"})
    steps, logged = 16, {}
    kw = (lambda s: {"step": s}) if use_step else (lambda s: {})

    def train(step, log=True):
        with mon.step(step):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        if log:
            logged[step] = float(loss.detach())
            wandb.log({"loss": logged[step]}, **kw(step))   # raises if init gave the wrong run

    first = 0
    if order == "init-watch-log":
        run = wandb.init(project="user-project", dir=str(tmp_path))
        mon = sw.watch(model, optimizer=opt, config=cfg, run_dir=tmp_path)
    elif order == "watch-init-log":
        mon = sw.watch(model, optimizer=opt, config=cfg, run_dir=tmp_path)
        assert wandb_reader.find_run_files(str(tmp_path)) == []   # no run of the monitor's
        for s in range(3):          # steps before any run exists: held, not a run of its own
            train(s, log=False)
        first = 3
        run = wandb.init(project="user-project", dir=str(tmp_path))
    else:
        run = wandb.init(project="user-project", dir=str(tmp_path))
        logged[0] = -1.0
        wandb.log({"loss": -1.0}, **kw(0))
        mon = sw.watch(model, optimizer=opt, config=cfg, run_dir=tmp_path)
        first = 1
    assert run.project == "user-project" and wandb.run is run
    watched = 1 if order == "init-log-watch" else 0     # the monitor's first step
    for s in range(first, steps):
        train(s)
    mon.close()
    wandb.log({"eval": 1.0}, **kw(steps - 1))   # the run is still yours after close
    run.finish()

    records, _ = read_run(tmp_path)
    rows = wandb_reader.history_rows(records)
    loss = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert [v for _, v in loss] == [logged[s] for s in sorted(logged)]   # every point
    if use_step:
        assert [s for s, _ in loss] == sorted(logged)                  # on its own step
    assert [r.get("eval") for r in rows if "eval" in r] == [1.0]
    # the monitor's values: each on its own row, each row one step of the monitor, equal to
    # what stats.jsonl says for that step
    stats = {}
    for line in open(tmp_path / "stats.jsonl"):
        r = json.loads(line)
        if (r["module"], r["tensor"]) == ("0", "output"):
            stats[r["step"]] = r["stats"]
    ours = [r for r in rows if "sw/step" in r]
    seen = [r["sw/step"] for r in ours]
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(watched, steps))
    key = "sw.output.absmax/0"
    with_stats = [r for r in ours if key in r]
    assert with_stats, "no statistics reached the run"
    for r in with_stats:
        assert r[key] == stats[r["sw/step"]]["absmax"]
        assert r["sw.output.e4m3_underflow_frac/0"] == stats[r["sw/step"]]["e4m3_underflow_frac"]
    dropped = last_summary(records, "sw/rows_dropped")
    assert len(seen) + dropped == steps - watched   # the rest is counted, never silent
    metrics = wandb_reader.records_of(records, "metric")
    assert any(m.glob_name == "sw.*" and m.step_metric == "sw/step" for m in metrics)
    # the monitor's Config, versions, rank and world size in the run config
    got = sw_config(records)
    assert got["every"] == 2 and got["formats"] == {"output": "e4m3"}
    assert got["versions"]["stabilitywatch"] == sw.__version__
    assert got["versions"]["torch"] == torch.__version__
    assert (got["rank"], got["world_size"]) == (0, 1)


def test_values_go_into_the_users_open_row_and_never_commit(tmp_path):
    # one step of the monitor per row of yours: a second waits for your next wandb.log
    run = wandb.init(project="user-project", dir=str(tmp_path))
    sink = WandbSink(tmp_path / "ignored", dashboard=Dashboard(("absmax",)))
    assert sink.run is run and not sink.owns_run
    run.log({"loss": 3.0}, step=5)
    sink.log([record(40, "fc", "weight", absmax=7.0)])
    sink.log([record(41, "fc", "weight", absmax=8.0)])
    assert run.step == 5                        # never advanced by the sink
    run.log({"loss": 2.0}, step=6)
    sink.flush()
    run.log({"loss": 1.0}, step=7)
    sink.close()
    run.log({"loss": 0.5}, step=8)              # still open after the sink closed
    run.finish()
    rows = wandb_reader.history_rows(read_run(tmp_path)[0])
    assert [(r["_step"], r["loss"]) for r in rows] == [(5, 3.0), (6, 2.0), (7, 1.0), (8, 0.5)]
    assert [(r["_step"], r["sw/step"], r["sw.weight.absmax/fc"]) for r in rows
            if "sw/step" in r] == [(5, 40, 7.0), (6, 41, 8.0)]
    assert not (tmp_path / "ignored").exists()


# -- alerts, histograms and the table, in a run of the monitor's own --------------------------
def test_alerts_histograms_and_table_read_back(tmp_path):
    cfg = sw.Config(every=3)
    sink = WandbSink(tmp_path, run_name="sw-test", config=cfg, run="own")
    assert sink.owns_run and wandb.run is None      # its own run never becomes wandb.run
    now = [1000.0]
    sink.plan.clock = lambda: now[0]
    hist = np.zeros(HIST_BINS)
    hist[[96 - 4, 96 + 1]] = [3, 9]                 # exponents -4 and 1
    sent = []
    steps = (0, 10, 20, *range(21, 28))
    for step in steps:
        sink.log([record(step, "layers.0", "output", hist=hist, absmax=step + 0.5, numel=64.0,
                         rms=0.1, nan=0.0, posinf=0.0, neginf=1.0),
                  record(step, "", "loss", mean=float("nan") if step == 20 else 2.0, nan=0.0,
                         posinf=0.0, neginf=0.0)])
        # step 20: 20 infos, then 3 warnings, then 2 criticals; later steps: a warning each,
        # more than the warnings' budget of a minute
        if step == 20:
            batch = ([make_alert(20, Severity.INFO, module=f"i{i}") for i in range(20)]
                     + [make_alert(20, Severity.WARNING, module=f"w{i}") for i in range(3)]
                     + [make_alert(20, Severity.CRITICAL, module=f"c{i}", value=math.inf)
                        for i in range(2)])
        elif step > 20:
            batch = [make_alert(step, Severity.WARNING, module=f"late{step}"),
                     make_alert(step, Severity.INFO, module=f"info{step}")]
        else:
            batch = []
        for a in batch:
            sink.alert(a)
        sent += batch
    last = make_alert(30, Severity.CRITICAL, detector="nonfinite", capture="captures/step30")
    sink.alert(last)
    sent.append(last)
    sink.close()
    sink.close()

    records, run_files = read_run(tmp_path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header" and "run" in kinds and kinds[-1] == "exit"   # finished on close
    rows = wandb_reader.history_rows(records)
    stat_rows = [r for r in rows if "sw.output.absmax/layers.0" in r]
    assert [r["sw/step"] for r in stat_rows] == list(steps)
    assert [r["sw.output.absmax/layers.0"] for r in stat_rows] == [s + 0.5 for s in steps]
    assert [r["sw.output.nonfinite/layers.0"] for r in stat_rows] == [1.0] * len(steps)
    assert all("sw.output.numel/layers.0" not in r for r in rows)   # not in the budget
    loss = [r["sw.loss.mean/model"] for r in stat_rows]
    assert loss[:2] == [2.0, 2.0] and math.isnan(loss[2])
    h = stat_rows[0]["sw.output.exponents/layers.0"]
    assert h["_type"] == "histogram" and h["bins"] == [-4, -3, -2, -1, 0, 1, 2]
    assert h["values"] == [3, 0, 0, 0, 0, 9]
    counts = [(r["sw/step"], r["sw.alerts/critical"], r["sw.alerts/warning"])
              for r in rows if "sw.alerts/critical" in r]
    want = []
    for step in sorted({a.step for a in sent}):
        upto = [a for a in sent if a.step <= step]
        want.append((step, sum(a.severity is Severity.CRITICAL for a in upto),
                     sum(a.severity is Severity.WARNING for a in upto)))
    assert counts == want

    # every warning and critical reached wandb.alert (offline, an alert record each)
    out = wandb_reader.records_of(records, "alert")
    text = "\n".join(a.text for a in out)
    for a in sent:
        if a.severity is not Severity.INFO:
            assert a.line() in text, a.line()
    first = out[0]
    assert first.level == "ERROR" and first.text.splitlines()[0].startswith(
        "[stabilitywatch] CRITICAL step 20")                 # criticals first
    assert len(out) < len(sent) / 4                          # batched and limited
    assert all(len(a.title) < 64 and a.title.startswith("stabilitywatch: ") for a in out)
    assert "info alert(s) held back" in text

    # the table holds every alert, and was written as they came (not only at close)
    table = last_summary(records, TABLE_KEY)
    assert table["_type"] == "table-file" and table["nrows"] == len(sent) and table["ncols"] == 11
    data = table_rows(run_files, table)
    assert [row[4] for row in data] == [a.module for a in sent]
    assert data[-1][2] == "nonfinite" and data[-1][10] == "captures/step30"
    crit = [row for row in data if row[3] == "critical"]
    assert crit[0][7] == math.inf and data[0][10] is None
    tables = [json.loads(i.value_json)["nrows"] for s in wandb_reader.records_of(records, "summary")
              for i in s.update if i.key == TABLE_KEY]
    assert tables[0] < len(sent) and tables == sorted(tables)
    # the Config in the run's config
    assert sw_config(records)["every"] == 3


def test_no_run_of_its_own_before_close_when_the_user_never_starts_one(tmp_path):
    sink = WandbSink(tmp_path)
    for step in range(5):
        sink.log([record(step, "fc", "grad", absmax=float(step))])
    sink.alert(make_alert(3, Severity.CRITICAL))
    sink.log([record(5, "fc", "grad", absmax=5.0)])
    assert sink.run is None and wandb_reader.find_run_files(str(tmp_path)) == []
    sink.close()
    records, _ = read_run(tmp_path)
    rows = wandb_reader.history_rows(records)
    assert [(r["sw/step"], r["sw.grad.absmax/fc"]) for r in rows if "sw.grad.absmax/fc" in r] \
        == [(s, float(s)) for s in range(6)]
    assert [a.level for a in wandb_reader.records_of(records, "alert")] == ["ERROR"]
    assert last_summary(records, "sw/rows_dropped") == 0


def test_killed_run_keeps_the_alerts_table(tmp_path):
    # the process dies without close(): the alerts so far are in the run's summary. A process
    # of its own (torch and wandb start again): ~5 s here. It takes this process's W&B service
    # (wandb.setup(): the documented set-up for child processes), which outlives it; a service
    # of its own would be stopped with it, losing what it had not yet written. That service
    # writes a run's records to its file every 15 s (x_transaction_log_flush_interval): the
    # child's run asks for 0.2 s, so the read below does not wait for the default.
    script = textwrap.dedent(f"""
        import os, time
        from stabilitywatch.alert import Alert, Severity
        from stabilitywatch.sinks import WandbSink
        sink = WandbSink({str(tmp_path)!r}, run="own")
        for i in range(3):
            sink.alert(Alert(step=i, detector="nonfinite", severity=Severity.CRITICAL,
                             module="fc", tensor="grad", stat="nan", value=1.0, threshold=0.0,
                             message="nan"))
        time.sleep(0.5)
        os._exit(9)
    """)
    wandb.setup()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "WANDB_MODE": "offline",
           "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.2"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert proc.returncode == 9
    (path,) = wandb_reader.find_run_files(str(tmp_path))
    records = wandb_reader.read_finished_run(path, timeout=60, need_exit=False,
                                             until=lambda rs: last_summary(rs, TABLE_KEY))
    assert last_summary(records, TABLE_KEY)["nrows"] >= 2


def test_failing_wandb_alert_does_not_break_the_sink(tmp_path, monkeypatch):
    sink = WandbSink(tmp_path, run="own")

    def broken(**kwargs):
        raise RuntimeError("alerts unavailable")

    monkeypatch.setattr(sink.run, "alert", broken)
    sink.alert(make_alert(1))
    sink.alert(make_alert(2))
    sink.log([record(2, "fc", "grad", absmax=1.0)])
    assert len(sink.alerts) == 2
    sink.close()
    records, _ = read_run(tmp_path)
    rows = wandb_reader.history_rows(records)
    assert any("sw.grad.absmax/fc" in r for r in rows)
    assert last_summary(records, TABLE_KEY)["nrows"] == 2


def test_missing_wandb_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install stabilitywatch\[wandb\]"):
        WandbSink(tmp_path)


def test_reader_reassembles_records_split_across_blocks(tmp_path):
    sink = WandbSink(tmp_path, run="own", dashboard=Dashboard(("absmax",)))
    # One history row of ~100 KiB: it must be split into FIRST/MIDDLE/LAST chunks.
    sink.log([record(1, f"blocks.{i}.attention.output_projection", "output", absmax=float(i))
              for i in range(1500)])
    sink.close()
    records, _ = read_run(tmp_path)
    (path,) = wandb_reader.find_run_files(str(tmp_path))
    assert os.path.getsize(path) > 2 * wandb_reader.BLOCK_SIZE
    kinds = [k for k, _ in wandb_reader.iter_chunks(path)]
    assert kinds.count(wandb_reader.FIRST) >= 1 and kinds.count(wandb_reader.MIDDLE) >= 1
    (row,) = [r for r in wandb_reader.history_rows(records) if r.get("sw/step") == 1]
    values = [row[f"sw.output.absmax/blocks.{i}.attention.output_projection"]
              for i in range(1500)]
    assert values == [float(i) for i in range(1500)]


def test_user_run_finished_before_close(tmp_path, caplog):
    # your run ends first: the sink says so once and starts no run of its own afterwards
    run = wandb.init(project="user-project", dir=str(tmp_path))
    sink = WandbSink(tmp_path, dashboard=Dashboard(("absmax",)))
    run.log({"loss": 1.0})
    sink.log([record(0, "fc", "grad", absmax=1.0)])
    run.log({"loss": 0.5})
    run.finish()
    sink.log([record(1, "fc", "grad", absmax=2.0)])
    sink.alert(make_alert(1, Severity.CRITICAL))
    sink.close()
    assert len(wandb_reader.find_run_files(str(tmp_path))) == 1
    rows = wandb_reader.history_rows(read_run(tmp_path)[0])
    assert [r["loss"] for r in rows if "loss" in r] == [1.0, 0.5]
    assert [r["sw.grad.absmax/fc"] for r in rows if "sw.grad.absmax/fc" in r] == [1.0]
    assert sink.dropped == 1   # step 1 (its values and its alert count), counted
