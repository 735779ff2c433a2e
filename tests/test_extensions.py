"""Your own detectors and sinks: Config takes instances beside the names, checks them where they
enter, and the monitor runs them under the never-break rule; the README's example runs."""
import json
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.capture.treeio import config_from_json, config_to_json

README = Path(__file__).resolve().parent.parent / "README.md"


def _loop(config, run_dir, steps=4, scale=10.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with sw.watch(model, opt, config=config, run_dir=run_dir) as mon:
        for step in range(steps):
            with mon.step(step, batch=x):
                loss = ((model(x) - y) ** 2).mean() * scale
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    return mon


def _alerts(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "alerts.jsonl")]


class StepAlert:
    """Duck-typed: a name and a check(frame), no base class."""
    name = "every_step"

    def __init__(self):
        self.frames = []

    def check(self, frame):
        self.frames.append(frame.step)
        i = frame.index("", "loss")
        v = frame.derived(i)["max"] if i is not None else float("nan")
        return [sw.Alert(step=frame.step, detector=self.name, severity=sw.Severity.WARNING,
                         module="", tensor="loss", stat="max", value=v, threshold=0.0,
                         message="seen")]


class Raising(sw.Detector):
    name = "raising"

    def __init__(self):
        self.calls = 0

    def check(self, frame):
        self.calls += 1
        raise RuntimeError("boom")


class WrongAlerts(Raising):
    name = "wrong"

    def __init__(self, alerts):
        super().__init__()
        self.alerts = alerts

    def check(self, frame):
        self.calls += 1
        return self.alerts(frame)


def test_a_user_detector_runs_on_every_frame_and_its_alerts_reach_the_sinks(tmp_path):
    det = StepAlert()
    mon = _loop(sw.Config(detectors=("drift", det), sinks=("jsonl",), incidents={"cooldown": 1}),
                tmp_path / "run")
    assert det.frames == [0, 1, 2, 3]
    mine = [a for a in _alerts(tmp_path / "run") if a["detector"] == "every_step"]
    assert [a["step"] for a in mine] == [0, 1, 2, 3]
    assert all(a["tensor"] == "loss" and a["value"] > 0 and a["incident"] for a in mine)
    assert [a.step for a in mon.alerts if a.detector == "every_step"] == [0, 1, 2, 3]


@pytest.mark.parametrize("make, why", [
    (lambda: Raising(), "RuntimeError: boom"),
    (lambda: WrongAlerts(lambda f: "not a list"), "not a list of Alert"),
    (lambda: WrongAlerts(lambda f: [{"step": f.step}]), "dict in its list"),
    (lambda: WrongAlerts(lambda f: [sw.Alert(f.step, "drift", sw.Severity.WARNING, "", "loss",
                                             "max", 1.0, 0.0, "x")]), "detector='drift'"),
    (lambda: WrongAlerts(lambda f: [sw.Alert(f.step, "wrong", "warning", "", "loss", "max",
                                             1.0, 0.0, "x")]), "severity='warning'"),
], ids=["raises", "not-a-list", "not-alerts", "other-name", "string-severity"])
def test_a_failing_user_detector_is_switched_off_with_one_warning(tmp_path, caplog, make, why):
    det, other = make(), StepAlert()
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        _loop(sw.Config(detectors=(det, other), sinks=("jsonl",), incidents={"cooldown": 1}),
              tmp_path / "run")
    assert det.calls == 1          # switched off after the first failure
    assert other.frames == [0, 1, 2, 3]   # the others and the run go on
    msgs = [r.getMessage() for r in caplog.records if repr(det.name) in r.getMessage()]
    assert len(msgs) == 1 and "switched off" in msgs[0] and why in msgs[0], msgs
    dets = {a["detector"] for a in _alerts(tmp_path / "run")}
    assert det.name not in dets and "every_step" in dets


class NoName:
    def check(self, frame):
        return []


class Named(NoName):
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("entry, message", [
    (StepAlert, "StepAlert is a class; pass an instance"),
    (object(), "objects with a check(frame) method"),
    (NoName(), "needs a `name` of its own"),
    (Named(""), "needs a `name` of its own"),
    (Named("nonfinite"), "built-in detector's name"),
    ("drfit", "unknown detector 'drfit'"),
    (3, "objects with a check(frame) method"),
], ids=["class", "no-check", "no-name", "empty-name", "builtin-name", "unknown-name", "int"])
def test_config_rejects_bad_detector_entries_where_they_enter(entry, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sw.Config(detectors=("drift", entry))


def test_config_rejects_a_detector_twice_by_instance_or_name():
    det = StepAlert()
    with pytest.raises(ValueError, match="'every_step' appears twice"):
        sw.Config(detectors=(det, det))
    with pytest.raises(ValueError, match="'every_step' appears twice"):
        sw.Config(detectors=(StepAlert(), StepAlert()))


def test_config_keeps_the_instance_and_replay_drops_it():
    det = StepAlert()
    cfg = sw.Config(detectors=("spike", det))
    assert cfg.detectors == ("spike", det) and cfg.replace(every=5).detectors[1] is det
    assert isinstance(det, sw.Detector) and not isinstance(object(), sw.Detector)
    back = config_from_json(json.loads(json.dumps(config_to_json(cfg))))
    assert back.detectors == ("spike",)


def _readme_block(heading):
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_detector_and_sink_example_runs(tmp_path):
    block = _readme_block("### Your own detector and sink")
    ns = {"__name__": "readme"}
    exec(compile(block, "README.md", "exec"), ns)
    config = ns["config"]
    lines = next(s for s in config.sinks.use if not isinstance(s, str))
    _loop(config.replace(incidents={"cooldown": 1}), tmp_path / "high", steps=3, scale=100.0)
    assert len(lines.lines) == 3 and all("loss_above" in x for x in lines.lines)
    assert [a["step"] for a in _alerts(tmp_path / "high") if a["detector"] == "loss_above"] \
        == [0, 1, 2]
    lines.lines.clear()
    _loop(config.replace(incidents={"cooldown": 1}), tmp_path / "low", steps=3, scale=1e-3)
    assert lines.lines == []
