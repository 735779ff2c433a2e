"""Drift, spike and shadow detectors on synthetic frames, and their Config fields."""
import math

import numpy as np
import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.detectors import DriftDetector, SpikeDetector, build_detectors
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.reference import reference_row


def frame(step, tensors):
    """tensors: {(module, role): tensor}"""
    keys = list(tensors)
    rows = np.stack([reference_row(t).numpy() for t in tensors.values()])
    return StatsFrame(step=step, keys=keys, rows=rows, scales=[1.0] * len(keys),
                      phases=[Phase.FORWARD] * len(keys))


def run(det, frames):
    return [a for f in frames for a in det.check(f)]


def test_loss_spike_and_quiet_noise():
    g = torch.Generator().manual_seed(0)
    losses = [2.0 - 0.01 * i + 0.05 * torch.randn(1, generator=g).item() for i in range(60)]
    losses[45] = 3.5
    det = SpikeDetector(sw.Config())
    alerts = run(det, [frame(i, {("", "loss"): torch.tensor([v])}) for i, v in enumerate(losses)])
    assert [(a.step, a.tensor, a.severity.value) for a in alerts] == [(45, "loss", "warning")]


def test_grad_norm_spike_global_and_layers():
    det = SpikeDetector(sw.Config())
    frames = []
    for i in range(30):
        k = 100.0 if i == 25 else 1.0 + 0.05 * math.sin(i)
        frames.append(frame(i, {("a", "grad"): torch.full((64,), 0.01 * k),
                                ("b", "grad"): torch.full((64,), 0.01)}))
    alerts = run(det, frames)
    loud = [(a.step, a.module, a.tensor) for a in alerts if a.severity.value == "warning"]
    assert loud == [(25, "", "grad_norm")]
    assert "largest per-layer jump: a" in next(a for a in alerts if a.module == "").message
    assert [(a.step, a.module) for a in alerts if a.severity.value == "info"] == [(25, "a")]


@pytest.mark.parametrize("kind", ["attn", "logz"])
def test_logit_growth(kind):
    det = SpikeDetector(sw.Config())
    frames = []
    for i in range(40):
        if kind == "attn":
            v = 2.0 * (1.15 ** max(0, i - 15))
            frames.append(frame(i, {("blk.scores", "attn_logits"): torch.tensor([v, -1.0])}))
        else:
            frames.append(frame(i, {("head", "logz"): torch.full((8,), 3.0 - max(0, i - 20))}))
    alerts = run(det, frames)
    assert alerts and all(a.severity.value == "warning" for a in alerts)
    first = alerts[0]
    if kind == "attn":   # 2 * 1.15**k >= 10 (floor) and >= 4x the early median 2 at k = 12
        assert (first.step, first.tensor) == (27, "attn_logits")
    else:                # 10 nats below 3 at i = 31
        assert (first.step, first.tensor, first.stat) == (31, "logz", "mean")


def test_forecast_warns_before_overflow_and_change_points_are_info():
    cfg = sw.Config(formats={"output": "e4m3"})
    det = DriftDetector(cfg)
    frames = [frame(i, {("m", "output"): torch.tensor([2.0 * 1.25 ** max(0, i - 10), 0.5])})
              for i in range(40)]
    alerts = run(det, frames)
    fc = [a for a in alerts if a.stat == "e4m3_steps_to_overflow"]
    overflow_step = next(i for i in range(40) if 2.0 * 1.25 ** max(0, i - 10) > 448)
    assert fc and fc[0].step < overflow_step and fc[0].severity.value == "warning"
    assert abs(fc[0].extra["overflow_step"] - overflow_step) <= 2
    assert all(a.severity.value == "info" for a in alerts if a not in fc)


def test_forecast_ignores_a_single_jump():
    det = DriftDetector(sw.Config(formats={"output": "e4m3"}))
    vals = [20.0 + 0.1 * math.sin(i) for i in range(20)] + [60.0] * 5
    alerts = run(det, [frame(i, {("m", "output"): torch.tensor([v])}) for i, v in enumerate(vals)])
    assert not [a for a in alerts if a.severity.value != "info"]


def test_detector_config_fields():
    assert len(build_detectors(sw.Config(detectors=()))) == 2
    # the last "spike" is the optimizer-update detector (detectors/update.py)
    assert [d.name for d in build_detectors(sw.Config())][2:] == ["drift", "spike", "shadow",
                                                                  "spike"]
    assert sw.Config(drift={"warn_bits": 4}).drift.warn_bits == 4.0
    assert sw.Config.from_dict({"detectors": ["spike"], "spike": {"z": 8}}).spike.z == 8.0
    for bad, field in [({"detectors": ("dirft",)}, "detectors"),
                       ({"drift": {"min_history": 60}}, "drift.min_history"),
                       ({"spike": {"z": -1}}, "spike.z"), ({"spike": {"z": math.nan}}, "spike.z"),
                       ({"drift": {"forecast_confidence": 1.5}}, "drift.forecast_confidence"),
                       ({"shadow": {"growth": 0.5}}, "shadow.growth"),
                       ({"drift": {"stats": ("mean",)}}, "drift.stats"),
                       ({"shadow": {"model": 1}}, "shadow.model"),
                       ({"drift": {"window": True}}, "drift.window")]:
        with pytest.raises(ValueError, match=field):
            sw.Config(**bad)


def test_logits_tap_rows_and_bad_glob(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), sw.LogitsTap("output"))
    with sw.watch(model, config=sw.Config(every=1, sinks=("jsonl",)), run_dir=tmp_path) as mon:
        with mon.step(0):
            model(torch.randn(3, 4))
    import json
    recs = {(r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(tmp_path / "stats.jsonl"))}
    assert recs[("1", "logz")]["numel"] == 3 and ("1", "logits") in recs
    with pytest.raises(ValueError, match="attn_logits"):
        sw.watch(model, config=sw.Config(attn_logits=("nope",), sinks=()), run_dir=tmp_path)
    with pytest.raises(ValueError, match="kind"):
        sw.LogitsTap("values")
