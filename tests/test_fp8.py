"""FP8 linear layers with delayed scaling, watched: the casts are read at the scale actually used
(saturation = overflow counts), the FP8 tensors and the amax history are visible."""
import json

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.integrations.fp8 import E4M3_MAX, Fp8Linear

FORMATS = {"fp8.input": "e4m3", "fp8.weight": "e4m3", "fp8.grad_output": "e5m2"}


def model_and_data(device="cpu"):
    torch.manual_seed(0)
    # margin=1: a factor 2 of headroom, so ordinary batch-to-batch growth does not saturate
    model = nn.Sequential(Fp8Linear(32, 64, margin=1), nn.GELU(),
                          Fp8Linear(64, 16, margin=1)).to(device)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=g).to(device) for _ in range(7)]
    return model, xs


def train(model, xs, mon, spike_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, x in enumerate(xs):
        if step == spike_step:
            x = x * 100  # an outlier batch beyond what the amax history has seen
        with mon.step(step):
            loss = model(x).float().square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()


def records(path):
    return {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(path / "stats.jsonl"))}


def test_fp8_casts_are_watched_at_their_scale(tmp_path):
    model, xs = model_and_data()
    cfg = sw.Config(every=1, formats=FORMATS, sinks=("jsonl",))
    with sw.watch(model, config=cfg, run_dir=tmp_path) as mon:
        train(model, xs, mon, spike_step=4)
    recs = records(tmp_path)
    for role in ("fp8.input", "fp8.input.e4m3", "fp8.weight", "fp8.weight.e4m3",
                 "fp8.grad_output", "fp8.grad_output.e5m2", "fp8.amax_history.input"):
        assert (3, "0", role) in recs and (3, "2", role) in recs, role
    # delayed scaling: the spike saturates the cast of layer 0's input at step 4 only
    over = {s: recs[(s, "0", "fp8.input")]["e4m3_overflow"] for s in range(7)}
    assert over[4] > 0 and all(over[s] == 0 for s in (0, 1, 2, 3)), over
    # the FP8 tensor itself never exceeds the format (saturating cast)
    assert recs[(4, "0", "fp8.input.e4m3")]["absmax"] <= E4M3_MAX
    # headroom is computed at the tensor-valued scale that was used: the 1-bit margin when
    # scaled from the current amax (step 0), below 0 when saturating (step 4)
    assert recs[(0, "0", "fp8.input")]["e4m3_headroom_bits"] == pytest.approx(1, abs=1e-6)
    assert recs[(4, "0", "fp8.input")]["e4m3_headroom_bits"] < -5
    # the amax history that drives the scale: its max is the largest amax seen so far
    hist = recs[(5, "0", "fp8.amax_history.input")]
    assert hist["max"] == pytest.approx(float((xs[4] * 100).abs().max()), rel=1e-6)
    crit = [(a.step, a.module, a.tensor, a.detector) for a in mon.alerts
            if a.severity.value != "info"]
    assert (4, "0", "fp8.input", "overflow") in crit
    assert all(a[0] == 4 for a in crit), crit


def test_fp8_layer_detached_after_close(tmp_path):
    model, xs = model_and_data()
    with sw.watch(model, config=sw.Config(every=1, sinks=("jsonl",)), run_dir=tmp_path):
        pass
    assert all(m._observe is None for m in model.modules() if isinstance(m, Fp8Linear))


def test_fp8_emulation_is_close_to_high_precision():
    model, xs = model_and_data()
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "amax" not in k})
    y, yr = model(xs[0]), ref(xs[0])
    rel = ((y - yr).norm() / yr.norm()).item()
    assert 1e-4 < rel < 0.1  # FP8 error: present, bounded
