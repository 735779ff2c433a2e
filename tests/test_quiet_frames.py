"""What a quiet unsampled step costs the monitor's threads: the detectors with nothing to read in
a loss-only frame are not run, the stages that only act on alerts are left out without alerts,
the console sink, whose log() is a no-op, is handed no records, and every step's records still
reach stats.jsonl."""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.detectors.base import idle
from stabilitywatch.kernels.dispatch import compute_row
from stabilitywatch.sinks import ConsoleSink, SinkRunner
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.sentinel import SentinelFrame

sys.path.insert(0, os.path.dirname(__file__))
from test_sinks import RecordingSink, make_record  # noqa: E402


def _monitor(tmp_path, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sw.Config(processing="inline", sinks=(), detectors=("drift", "spike", "shadow"), **kw)
    return sw.watch(model, opt, config=cfg, run_dir=tmp_path)


def _sentinel(step, keys):
    n = len(keys)
    return SentinelFrame(step=step, keys=list(keys), nonfinite=np.zeros(n), absmax=np.ones(n),
                         sumsq=np.ones(n), present=np.ones(n, bool), nan=np.zeros(n),
                         numel=np.full(n, 64))


def _frame(step, keys, sentinel_keys):
    rows = np.stack([compute_row(torch.randn(64) + 3.0).numpy() for _ in keys])
    phases = [Phase.LOSS if r == "loss" else Phase.FORWARD for _, r in keys]
    return StatsFrame(step=step, keys=list(keys), rows=rows, scales=[1.0] * len(keys),
                      phases=phases, sentinel=_sentinel(step, sentinel_keys))


def test_detectors_with_nothing_to_read_are_not_run_on_a_loss_only_frame(tmp_path):
    mon = _monitor(tmp_path)
    calls = []
    for det in mon.detectors:
        det.check = (lambda f, _d=det, _c=det.check: calls.append(type(_d).__name__) or _c(f))
    grads = mon.sentinel.keys
    loss_only = [("", "loss")]
    mon._handle(_frame(100, loss_only, grads))
    # the sentinel and the loss: nonfinite and spike; the learning rate: physics
    assert sorted(calls) == ["NonFiniteDetector", "PhysicsDetector", "SpikeDetector"]
    assert [type(d).__name__ for d in mon.detectors if idle(d, tuple(loss_only))] == [
        "RangeDetector", "DriftDetector", "ShadowDetector", "UpdateDetector"]
    calls.clear()
    sampled = loss_only + [("0", "output"), ("0", "weight")]
    mon._handle(_frame(101, sampled, grads))
    assert "DriftDetector" in calls   # it has rows to judge now
    assert sorted(calls) == sorted(type(d).__name__ for d in mon.detectors
                                   if not idle(d, tuple(sampled)))

    class Late:   # a detector added to the list later is run on the next frame
        name = "late"

        def check(self, frame):
            calls.append("Late")
            return []
    mon.detectors.append(Late())
    calls.clear()
    mon._handle(_frame(102, loss_only, grads))
    assert "Late" in calls
    mon.close()


def test_the_console_sink_is_handed_no_records():
    console, other = ConsoleSink(), RecordingSink()
    runner = SinkRunner([console, other])
    runner.log([make_record(0)])
    assert [w.stats_in for w in runner._workers] == [0, 1]
    runner.close()
    assert len(other.records) == 1
    assert runner.report()["console"]["records_lost"] == 0


def test_a_run_writes_every_step_of_stats_jsonl(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.watch(model, opt, config=sw.Config(every=7, warmup=0, sinks=("jsonl",)),
                  run_dir=tmp_path) as mon:
        for step in range(30):
            with mon.step(step):
                loss = model(torch.randn(4, 8)).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    with open(tmp_path / "stats.jsonl") as f:
        lines = [json.loads(line) for line in f]
    losses = [r["step"] for r in lines if r["tensor"] == "loss"]
    norms = [r["step"] for r in lines if r["tensor"] == "grad_norm"]
    assert losses == norms == list(range(30))
