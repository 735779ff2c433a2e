"""Escalation: a tripped sentinel or a warning-or-worse alert switches the next steps to every
role for `escalate_steps`, then back; a forward fault first reported as "forward" on an
unsampled step is named at its module on an escalated step."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stabilitywatch as sw


class Faulty(nn.Module):
    """A linear layer owning its parameters whose output can be made Inf (the fault is inside
    the watched module, as a bad kernel's would be)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.broken = False

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.broken:
            y = y.index_fill(1, torch.tensor([0]), float("inf"))
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = Faulty(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _run(tmp_path, steps, config, broken=(), grad_nan=()):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            model.fc2.broken = step in broken
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                if step in grad_nan:
                    model.fc1.bias.grad[0] = float("nan")
                opt.step()
                opt.zero_grad()
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    return mon, recs


def _output_steps(recs):
    return sorted({r["step"] for r in recs if r["tensor"] == "output"})


@pytest.mark.parametrize("window", [3, 0], ids=["escalate", "off"])
def test_a_tripped_sentinel_switches_to_full_sampling_for_the_window_then_back(tmp_path, window):
    config = sw.Config(every=10, warmup=0, escalate_steps=window, sinks=("jsonl",))
    mon, recs = _run(tmp_path, 14, config, grad_nan=(4,))
    # on the CPU the frame of step 4 is read at its end: the window opens at step 5
    expected = [0, 5, 6, 7, 10] if window else [0, 10]
    assert _output_steps(recs) == expected
    if window:
        assert mon.schedule.windows == [(5, 8, "non-finite gradients at step 4")]
        roles = {r["tensor"] for r in recs if r["step"] == 6}
        assert {"input", "output", "grad_output", "weight", "grad"} <= roles
        assert all(r.get("escalated") for r in recs if r["step"] in (5, 6, 7))
        assert not any(r.get("escalated") for r in recs if r["step"] in (4, 8, 10))


@pytest.mark.parametrize("processing,lag", [("thread", 1), ("thread", 0), ("inline", 0),
                                            ("thread", 2)],
                         ids=["thread-lag1", "thread-lag0", "inline", "thread-lag2"])
def test_a_warning_alert_escalates(tmp_path, processing, lag):
    # a loss spike (warning) on an unsampled step: the steps after it read every role. The
    # alert comes from the frame of step 6, read at its end (CPU); processed inline, its
    # escalation opens the window at step 7, processed on the thread `lag` steps later
    config = sw.Config(every=10, warmup=0, escalate_steps=2, sinks=("jsonl",),
                       detectors=("spike",), spike={"min_history": 3}, processing=processing,
                       processing_lag=lag)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step in range(12):
            x = torch.randn(16, 8, generator=g) * (30.0 if step == 6 else 1.0)
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    spikes = [a for a in mon.alerts if a.detector == "spike" and a.tensor == "loss"]
    assert spikes and spikes[0].step == 6
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    first = 7 + (lag if processing == "thread" else 0)
    assert _output_steps(recs) == sorted({0, first, first + 1, 10})
    assert mon.schedule.windows[0][:2] == (first, first + 2)


def test_forward_inf_says_forward_then_escalation_names_the_module(tmp_path):
    config = sw.Config(every=10, warmup=0, escalate_steps=3, guard={"on_nonfinite": "skip"},
                       sinks=("jsonl",))
    mon, recs = _run(tmp_path, 9, config, broken=range(4, 9))
    crit = [a for a in mon.alerts if a.detector == "nonfinite" and a.severity.value == "critical"]
    assert [(a.step, a.module, a.tensor) for a in crit] == [(4, "", "loss"), (5, "fc2", "output")]
    assert crit[0].extra["phase"] == "forward" and "forward of step 4" in crit[0].message
    assert crit[1].extra["refines_step"] == 4
    assert all(a.extra.get("skipped") and "step skipped" in a.message for a in crit)


def rerun_step(model, batch):
    """The step function watch(step_fn=...) names for the in-place re-run."""
    return model(batch).square().mean()


def test_a_skipped_step_is_re_run_in_place_and_names_the_forward_module(tmp_path):
    # a transient forward fault (one step): no later step sees it, the re-run does
    config = sw.Config(every=10, warmup=0, escalate_steps=0, sinks=("jsonl",),
                       guard=sw.GuardConfig(on_nonfinite="skip", rerun_skipped=True))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    with sw.watch(model, opt, config=config, run_dir=tmp_path,
                  step_fn="test_escalation:rerun_step") as mon:
        for step in range(7):
            x = torch.randn(16, 8, generator=g)
            model.fc2.broken = step == 4
            with mon.step(step, batch=x):
                loss = rerun_step(model, x)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    assert mon.inplace.reruns == [4]
    crit = [a for a in mon.alerts if a.detector == "nonfinite" and a.severity.value == "critical"]
    assert [(a.step, a.module, a.tensor) for a in crit] == [(4, "", "loss"), (4, "fc2", "output")]
    assert crit[1].extra["rerun"] is True and crit[1].extra["refines_step"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the re-run left no gradients behind and the schedule as it was
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    assert _output_steps(recs) == [0]
