"""Incidents (stabilitywatch/incidents.py): one root per step's alerts, written first; change
points outside incidents are statistics; severities from the size and the physics."""
import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.alert import Alert, Severity
from stabilitywatch.detectors import SpikeDetector
from stabilitywatch.incidents import Incidents
from stabilitywatch.sinks.console import ConsoleSink
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.reference import reference_row

CONTRACT = {"schema", "step", "rank", "detector", "severity", "module", "tensor", "stat", "value",
            "threshold", "message", "capture", "incident", "root"}


def frame(step, keys, phases):
    rows = np.stack([reference_row(torch.ones(4)).numpy() for _ in keys])
    return StatsFrame(step=step, keys=keys, rows=rows, scales=[1.0] * len(keys), phases=phases)


def alert(step, module, tensor, sev="info", bits=None, detector="drift"):
    extra = {} if bits is None else {"bits": bits, "change_point": True}
    return Alert(step=step, detector=detector if bits is None else "drift",
                 severity=Severity(sev), module=module, tensor=tensor, stat="log2_absmax",
                 value=bits or 0.0, threshold=0.0, message=f"{module} {tensor}", extra=extra)


KEYS = [("a", "weight"), ("a", "output"), ("b", "output"), ("", "loss"), ("b", "grad_output"),
        ("b", "grad")]
PHASES = [Phase.WEIGHT, Phase.FORWARD, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.GRAD]


def cfg(**kw):
    return SimpleNamespace(incidents=SimpleNamespace(warn_bits=4.0, critical_bits=10.0), **kw)


def test_root_is_the_earliest_departure_and_comes_first():
    inc = Incidents(cfg())
    given = [alert(5, "", "grad_norm", "warning", detector="spike"),
             alert(5, "b", "output", bits=2.0),            # too small to be a root
             alert(5, "", "loss", "warning", detector="spike"),
             alert(5, "a", "output", bits=-5.0)]            # 32x down: the root
    out, stats = inc.group(frame(5, KEYS, PHASES), given)
    assert stats == []
    assert [(a.module, a.tensor) for a in out] == [("a", "output"), ("b", "output"), ("", "loss"),
                                                    ("", "grad_norm")]
    assert [a.root for a in out] == [True, False, False, False]
    assert {a.incident for a in out} == {"s5-1"}
    assert out[0].severity is Severity.WARNING          # a 5-bit root is a warning
    assert "+3 consequences" in out[0].message and out[0].extra["consequences"] == 3


def test_change_points_alone_are_statistics():
    inc = Incidents(cfg())
    given = [alert(7, "a", "output", bits=12.0), alert(7, "b", "grad", bits=3.0)]
    out, stats = inc.group(frame(7, KEYS, PHASES), given)
    assert out == [] and stats == given


def test_severity_from_bits_and_from_consequences():
    inc = Incidents(cfg())
    out, _ = inc.group(frame(3, KEYS, PHASES), [alert(3, "b", "grad", "warning", detector="spike"),
                                                alert(3, "a", "output", bits=11.0)])
    assert (out[0].module, out[0].severity) == ("a", Severity.CRITICAL)   # tens of bits
    out, _ = inc.group(frame(4, KEYS, PHASES),
                       [alert(4, "b", "grad_output", "critical", detector="nonfinite"),
                        alert(4, "a", "output", bits=4.5)])
    # the root names the cause; the incident is as severe as its worst consequence
    assert (out[0].module, out[0].root, out[0].severity) == ("a", True, Severity.CRITICAL)
    assert out[1].severity is Severity.CRITICAL and not out[1].root


def test_escalation_window_joins_unless_more_severe():
    inc = Incidents(cfg(escalate_steps=5))
    f = lambda s: frame(s, KEYS, PHASES)  # noqa: E731
    first, _ = inc.group(f(10), [alert(10, "", "loss", "warning", detector="spike")])
    later, _ = inc.group(f(12), [alert(12, "", "grad_norm", "warning", detector="spike"),
                                 alert(12, "b", "output", bits=6.0)])
    assert {a.incident for a in first + later} == {"s10-1"} and not any(a.root for a in later)
    worse, _ = inc.group(f(13), [alert(13, "b", "grad", "critical", detector="nonfinite")])
    assert worse[0].incident == "s13-1" and worse[0].root
    after, _ = inc.group(f(30), [alert(30, "", "loss", "warning", detector="spike")])
    assert after[0].incident == "s30-1"
    # a bad write is never the consequence of an earlier incident
    inc.group(f(40), [alert(40, "", "loss", "critical", detector="nonfinite")])
    write, _ = inc.group(f(41), [alert(41, "b", "grad", "critical", detector="nonfinite"),
                                 alert(41, "a", "weight", "critical", detector="physics")])
    assert [(a.detector, a.incident, a.root) for a in write] == [("physics", "s41-1", True),
                                                                  ("nonfinite", "s41-1", False)]


def test_console_logs_consequences_at_debug(caplog):
    inc = Incidents(cfg())
    out, _ = inc.group(frame(2, KEYS, PHASES), [alert(2, "", "loss", "warning", detector="spike"),
                                                alert(2, "a", "weight", "critical",
                                                      detector="physics")])
    sink = ConsoleSink()
    with caplog.at_level(logging.DEBUG, logger="stabilitywatch"):
        for a in out:
            sink.alert(a)
    levels = [(r.levelno, "incident s2-1" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.ERROR, True), (logging.DEBUG, True)]
    assert "+1 consequence:" in caplog.records[0].getMessage()


# -- end to end: a bad write in a real training loop ----------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.ln(self.fc1(x))))


def train(tmp_path, steps, fault=None, opt_fn=None, every=10, capture=("critical",)):
    torch.manual_seed(0)
    model = Net()
    opt = (opt_fn or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(32, 16, generator=g) for _ in range(steps)]
    config = sw.Config(every=every, sinks=("jsonl",), capture=capture)
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step in range(steps):
            if fault is not None:
                fault(model, step)
            with mon.step(step, batch=data[step]):
                loss = ((model(data[step]) - data[step][:, :4]) ** 2).mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    return mon.alerts


def times(k, at):
    def fault(model, step):
        if step == at:
            with torch.no_grad():
                model.fc1.weight.mul_(k)
    return fault


def flip(at):
    def fault(model, step):
        if step == at:
            with torch.no_grad():
                model.fc1.weight.view(-1).view(torch.int32)[3] ^= 1 << 30
    return fault


@pytest.mark.parametrize("fault", [times(1e4, 23), flip(30)],
                         ids=["x1e4-unsampled", "bitflip-sampled"])
def test_bad_write_is_one_critical_incident_at_the_next_read(tmp_path, fault):
    alerts = train(tmp_path, 32, fault)
    lines = [json.loads(x) for x in open(tmp_path / "alerts.jsonl")]
    assert lines and all(CONTRACT <= set(x) for x in lines)
    root = lines[0]
    assert (root["step"], root["severity"], root["detector"], root["module"], root["tensor"],
            root["root"], root["incident"]) == (30, "critical", "physics", "fc1", "weight",
                                                True, "s30-1")
    assert "silent data corruption" in root["message"]
    ours = [x for x in lines if x["incident"] == "s30-1"]
    n = len(ours) - 1
    assert not any(x["root"] for x in ours[1:])
    assert n == 0 or f"+{n} consequence" in root["message"]
    assert [a.to_dict()["incident"] for a in alerts] == [x["incident"] for x in lines]
    # the capture of the step lists the incident, root first
    manifest = json.loads(next((tmp_path / "captures").glob("*/manifest.json")).read_text())
    assert manifest["incidents"][0]["id"] == "s30-1"
    assert manifest["incidents"][0]["module"] == "fc1"
    assert manifest["incidents"][0]["consequences"] == n
    assert manifest["alerts"][0]["root"] is True


@pytest.mark.parametrize("opt_fn", [
    lambda p: torch.optim.Adam(p, lr=0.05),
    lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.02), weight_decay=0.1),
    lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True),
    lambda p: torch.optim.SGD(p, lr=0.5, weight_decay=1e-3)], ids=["adam", "adamw-tensor-lr",
                                                                   "sgd-nesterov", "sgd"])
def test_real_updates_stay_inside_the_bound(tmp_path, opt_fn):
    alerts = train(tmp_path, 40, opt_fn=opt_fn, every=1, capture=())
    assert not [a for a in alerts if a.detector == "physics"], [a.message for a in alerts]


def test_sgd_bad_write_with_every_step_read(tmp_path):
    alerts = train(tmp_path, 20, times(50.0, 12),
                   opt_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), every=1,
                   capture=())
    phys = [a for a in alerts if a.detector == "physics"]
    assert [(a.step, a.module, a.tensor, a.root) for a in phys] == [(12, "fc1", "weight", True)]


def test_loss_spike_while_the_loss_still_falls():
    det = SpikeDetector(sw.Config())
    g = torch.Generator().manual_seed(0)
    # 10.9 falling to 1.84 at step 22 (the window median lags at ~3.1), then 4.32
    losses = [1.6 + 9.3 * math.exp(-i / 6.0) + 0.03 * torch.randn(1, generator=g).item()
              for i in range(23)] + [4.32] + [1.75] * 5
    got = []
    for i, v in enumerate(losses):
        rows = reference_row(torch.tensor([v])).numpy()[None]
        got += det.check(StatsFrame(step=i, keys=[("", "loss")], rows=rows, scales=[1.0],
                                    phases=[Phase.LOSS]))
    assert [(a.step, a.tensor) for a in got] == [(23, "loss")]
    assert "recent level" in got[0].message


def test_config_fields():
    c = sw.Config(incidents={"warn_bits": 3, "critical_bits": 8}, update={"weight_margin": 1},
                  spike={"loss_recent": 3})
    assert (c.incidents.warn_bits, c.update.weight_margin) == (3.0, 1.0)
    for bad, name in [({"incidents": {"warn_bits": 0}}, "incidents.warn_bits"),
                      ({"incidents": {"warn_bits": 12}}, "incidents.warn_bits"),
                      ({"incidents": {"critical_bits": math.inf}}, "incidents.critical_bits"),
                      ({"update": {"weight_margin": 0.5}}, "update.weight_margin"),
                      ({"spike": {"loss_recent": 0}}, "spike.loss_recent")]:
        with pytest.raises(ValueError, match=name):
            sw.Config(**bad)


def test_a_second_bad_write_is_a_new_incident(tmp_path):
    def twice(model, step):
        if step in (20, 23):
            with torch.no_grad():
                model.fc1.weight.mul_(100.0)
    alerts = train(tmp_path, 25, twice, every=1, capture=())
    roots = [(a.step, a.detector, a.module, a.tensor) for a in alerts
             if a.root and a.severity.value != "info"]
    assert roots[:2] == [(20, "physics", "fc1", "weight"), (23, "physics", "fc1", "weight")]
