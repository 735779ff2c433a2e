"""Sinks that hang, crawl or raise, through a real Monitor on a tiny real model: alerts still
reach alerts.jsonl, the console and mon.alerts, no step waits, close() is bounded, run.json
counts what the bad sink did not write. Every hang is bounded (sink_scenarios.GATE_LIMIT, the
step bound, the close bound)."""
import json
import logging
import time

import pytest

from stabilitywatch import SinkConfig

from sink_scenarios import CountingSink, GatedSink, RaisingSink, read_jsonl, sink_warnings, train

STEP_BOUND = 1.0     # seconds: a step of this model takes ~30 ms; a stall takes seconds
CLOSE_SLACK = 2.0    # seconds close() may take past sink_close_timeout (flushing, joining)


def console_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "stabilitywatch" and r.getMessage().startswith("[stabilitywatch]")]


def check_alerts_kept(mon, run_dir, caplog):
    assert mon.alerts and any(a.severity.value == "critical" for a in mon.alerts)
    on_disk = read_jsonl(run_dir / "alerts.jsonl")
    assert [(a["step"], a["module"], a["tensor"], a["stat"]) for a in on_disk] == \
        [(a.step, a.module, a.tensor, a.stat) for a in mon.alerts]
    # warnings and criticals; an incident's consequences are debug lines (its root lists them)
    assert console_lines(caplog) == [a.line() for a in mon.alerts if a.root or not a.incident]


def test_sink_whose_log_hangs_loses_nothing_of_the_others(tmp_path, caplog):
    hung, counting = GatedSink("hung", "log"), CountingSink()
    try:
        with caplog.at_level(logging.INFO, logger="stabilitywatch"):
            sinks = SinkConfig(use=("jsonl", "console", hung, counting), timeout=0.5,
                               close_timeout=2.0)
            mon, times = train(tmp_path, sinks, steps=60, step_bound=STEP_BOUND)
            t0 = time.perf_counter()
            mon.close()
            closing = time.perf_counter() - t0
            written = hung.records, len(hung.alerts)   # while it is still stuck
    finally:
        hung.gate.set()
    assert len(mon.alerts) == 54 and max(times) < STEP_BOUND
    assert closing < 2.0 + CLOSE_SLACK
    check_alerts_kept(mon, tmp_path, caplog)
    assert [a.step for a in counting.alerts] == [a.step for a in mon.alerts]
    (warning,) = sink_warnings(caplog)
    assert warning.startswith("stabilitywatch: sink 'hung' timed out: log() did not return "
                              "within 0.5 s; switched off")
    report = json.loads((tmp_path / "run.json").read_text())["sinks"]
    assert report["jsonl"]["state"] == report["console"]["state"] == "ok"
    assert report["jsonl"]["alerts_lost"] == report["jsonl"]["records_lost"] == 0
    got = report["hung"]
    assert got["state"] == "timed_out" and "log() did not return within 0.5 s" in got["error"]
    # everything it was handed and did not write is counted
    assert got["alerts_lost"] + written[1] == len(mon.alerts)
    assert got["records_lost"] + got["records_dropped"] + written[0] == counting.records
    assert got["records_lost"] > 0


def test_full_queue_of_a_slow_sink_makes_no_step_wait(tmp_path, caplog):
    slow, counting = GatedSink("slow", "log"), CountingSink()
    try:
        with caplog.at_level(logging.INFO, logger="stabilitywatch"):
            sinks = SinkConfig(use=("jsonl", "console", slow, counting), queue_size=8,
                               timeout=60.0)
            mon, times = train(tmp_path, sinks, steps=30, step_bound=STEP_BOUND)
            assert slow.entered.is_set() and max(times) < STEP_BOUND
            slow.gate.set()          # the sink catches up: close() drains its queues
            mon.close()
    finally:
        slow.gate.set()
    check_alerts_kept(mon, tmp_path, caplog)
    # alerts are never dropped for lack of queue space, statistics are (counted)
    assert [a.step for a in slow.alerts] == [a.step for a in mon.alerts]
    reports = json.loads((tmp_path / "run.json").read_text())["sinks"]
    report = reports["slow"]
    assert report["state"] == "ok" and report["records_dropped"] > 0
    # what training handed the sinks (a fast sink on a busy host may drop a few steps too)
    given = counting.records + reports["counting"]["records_dropped"]
    assert report["records_dropped"] + slow.records == given
    (warning,) = [w for w in sink_warnings(caplog) if "'slow'" in w]
    assert warning.startswith("stabilitywatch: sink 'slow' is slower than training")
    assert all("is slower than training" in w for w in sink_warnings(caplog))


@pytest.mark.parametrize("method", ["log", "alert"])
@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit",
                                                                           "KeyboardInterrupt"])
def test_sink_raising_base_exception_is_switched_off_and_reported(tmp_path, caplog, exc, method):
    bad = RaisingSink(exc, method)
    with caplog.at_level(logging.INFO, logger="stabilitywatch"):
        mon, _ = train(tmp_path, ("jsonl", bad, "console"), step_bound=STEP_BOUND)
        mon.close()
    check_alerts_kept(mon, tmp_path, caplog)
    (warning,) = sink_warnings(caplog)
    name = type(exc).__name__
    assert warning.startswith(f"stabilitywatch: sink 'raising' failed ({name}")
    report = json.loads((tmp_path / "run.json").read_text())["sinks"]["raising"]
    assert report["state"] == "failed" and report["error"].startswith(name)
    assert report["alerts_lost"] + len(bad.alerts) == len(mon.alerts)


def test_sink_stuck_in_close_is_abandoned_within_the_bound(tmp_path, caplog):
    stuck = GatedSink("stuck", "close")
    try:
        with caplog.at_level(logging.INFO, logger="stabilitywatch"):
            mon, _ = train(tmp_path, SinkConfig(use=("jsonl", stuck), close_timeout=1.0), steps=10)
            t0 = time.perf_counter()
            mon.close()
            closing = time.perf_counter() - t0
    finally:
        stuck.gate.set()
    assert 1.0 <= closing < 1.0 + CLOSE_SLACK
    (warning,) = sink_warnings(caplog)
    assert warning.startswith("stabilitywatch: sink 'stuck' did not finish within 1 s of "
                              "close(); abandoned")
    report = json.loads((tmp_path / "run.json").read_text())["sinks"]
    assert report["stuck"]["state"] == "abandoned" and report["jsonl"]["state"] == "ok"
    assert len(read_jsonl(tmp_path / "alerts.jsonl")) == len(mon.alerts) == 4


def test_readme_plug_in_sink_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    import torch

    from sink_scenarios import Net

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("### Plug-in sinks"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    paged = []
    model = Net()
    ns = {"__name__": "readme", "model": model, "page_on_call": paged.append,
          "opt": torch.optim.SGD(model.parameters(), lr=1e-2)}
    exec(compile(block, "README.md", "exec"), ns)
    mon = ns["mon"]
    for step in range(3):
        x = torch.randn(4, 8)
        x[0, 0] = float("nan") if step == 2 else x[0, 0]
        with mon.step(step, batch=x):
            model(x).sum().backward()
    mon.close()
    assert len(paged) == 1 and paged[0].startswith("[stabilitywatch] CRITICAL step 2")
    report = json.loads((tmp_path / "runs/x/run.json").read_text())["sinks"]
    assert report["pager"]["state"] == "ok"
