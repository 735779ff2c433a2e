"""End to end: the demo's injected fault, seen through every sink a user looks at."""
import json
import os
import sys

import pytest

from stabilitywatch import Config
from stabilitywatch.demo import FAULT_MODULE, demo_config, run_demo

sys.path.insert(0, os.path.dirname(__file__))
import wandb_reader  # noqa: E402


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    os.environ["WANDB_MODE"] = "offline"
    out = tmp_path_factory.mktemp("demo")
    cfg = demo_config().replace(sinks=("jsonl", "console", "wandb", "tensorboard"))
    return run_demo(out, device="cpu", steps=12, fault_step=6, config=cfg)


def test_demo_catches_fault_at_step_and_module(demo):
    # the fault (the layer's weights x2e3) is a bad write: the root of the step's incident,
    # the E4M3 overflow of its output a consequence
    first = [a for a in demo.alerts if a.severity.value != "info"][0]
    assert (first.step, first.module, first.tensor, first.detector, first.root) == \
        (6, FAULT_MODULE, "weight", "physics", True)
    assert (6, FAULT_MODULE, "output", "overflow", first.incident) in \
        [(a.step, a.module, a.tensor, a.detector, a.incident) for a in demo.alerts]
    crit = [a for a in demo.alerts if a.detector == "nonfinite"]
    assert [(a.step, a.module, a.tensor) for a in crit] == [(9, FAULT_MODULE, "output")]
    lines = [json.loads(x) for x in open(demo.run_dir / "alerts.jsonl")]
    assert [(d["step"], d["module"], d["detector"]) for d in lines] == \
        [(a.step, a.module, a.detector) for a in demo.alerts]


def test_demo_wandb_run_holds_metrics_and_alerts(demo):
    pytest.importorskip("wandb")  # `make test` installs it; a bare GPU image may lack it
    files = wandb_reader.find_run_files(str(demo.run_dir))
    assert len(files) == 1
    recs = wandb_reader.read_finished_run(files[0])
    rows = wandb_reader.history_rows(recs)
    key = f"stabilitywatch/{FAULT_MODULE}/output/absmax"
    by_step = {r["stabilitywatch/step"]: r[key] for r in rows if key in r}
    assert set(range(12)) <= set(by_step)
    assert by_step[6] > 448 > by_step[5]          # the saturation is visible on the dashboard
    assert by_step[9] == float("inf") or by_step[9] > 1e30 or by_step[9] != by_step[9]
    alerts = wandb_reader.records_of(recs, "alert")
    assert any(FAULT_MODULE in a.text and "step 6" in a.text for a in alerts)


def test_demo_tensorboard_holds_metrics(demo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(demo.run_dir / "tensorboard"))
    acc.Reload()
    tag = f"stabilitywatch/{FAULT_MODULE}/output/e4m3_overflow_frac"
    events = {e.step: e.value for e in acc.Scalars(tag)}
    assert events[5] == 0 and events[6] > 0.5


def test_default_config_is_quiet_on_a_healthy_run(tmp_path):
    r = run_demo(tmp_path, device="cpu", steps=30, fault_step=10**6,
                 config=Config(formats={"output": "e4m3"}, sinks=("jsonl",)))
    assert [a for a in r.alerts if a.severity.value != "info"] == []
