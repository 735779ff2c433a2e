"""Accelerate: `sw.watch` on the prepared model and Accelerate's wrapped optimizer (the hooks go
on the torch optimizer inside), in a loop with gradient accumulation 2 (CPU)."""
import json

import pytest
import torch
import torch.nn as nn

accelerate = pytest.importorskip("accelerate")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.integrations.accelerate import unwrap_optimizer  # noqa: E402

STEPS, BATCH = 5, 4


def setup(accumulate):
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(n)]


def train(acc, model, opt, mon, accumulate, nan_at=None):
    micro = data(STEPS * accumulate)
    losses = []
    for step in range(STEPS):
        batches = micro[step * accumulate:(step + 1) * accumulate]
        if step == nan_at:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        with mon.step(step, batch=batches):
            for x, y in batches:
                with acc.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    acc.backward(loss)
                    mon.observe_loss(loss)
                    losses.append(float(loss.detach()))
                    opt.step()        # a no-op until the last micro-batch of the step
                    opt.zero_grad()
    return losses


def stats(run_dir):
    return {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(run_dir / "stats.jsonl"))}


def test_wrapped_optimizer_is_unwrapped():
    acc, model, opt = setup(1)
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
    assert unwrap_optimizer(opt) is opt.optimizer
    inner = opt.optimizer
    assert unwrap_optimizer(inner) is inner and unwrap_optimizer(None) is None


def test_accelerate_accumulation_one_frame_per_step(tmp_path):
    acc, model, opt = setup(2)
    mon = sw.watch(model, opt, config=sw.Config(every=1, sinks=("jsonl",)), run_dir=tmp_path)
    assert mon.optimizer is opt.optimizer
    with mon:
        losses = train(acc, model, opt, mon, 2)
    assert mon.frames_seen == STEPS
    recs = stats(tmp_path)
    for step in range(STEPS):
        assert recs[(step, "0", "output")]["numel"] == 2 * BATCH * 16
        # the loss row merges the two micro-batch losses: its mean is theirs
        pair = losses[2 * step: 2 * step + 2]
        assert recs[(step, "", "loss")]["mean"] == pytest.approx(sum(pair) / 2, rel=1e-6)
        # hooks on the real optimizer: gradients and Adam state once per optimizer step
        assert recs[(step, "0", "grad")]["numel"] == 16 * 8
        assert recs[(step, "0", "optim.exp_avg")]["numel"] == 16 * 8
    assert int(opt.optimizer.state[model[0].weight]["step"]) == STEPS
    assert not [a for a in mon.alerts if a.severity != sw.Severity.INFO]


def test_accelerate_nan_weight_is_named(tmp_path):
    acc, model, opt = setup(2)
    with sw.watch(model, opt, config=sw.Config(every=1, sinks=("jsonl",)),
                  run_dir=tmp_path) as mon:
        train(acc, model, opt, mon, 2, nan_at=3)
    crit = [a for a in mon.alerts if a.severity == sw.Severity.CRITICAL]
    assert crit and (crit[0].step, crit[0].detector, crit[0].module, crit[0].tensor) == \
        (3, "nonfinite", "2", "weight")


def test_lightning_optimizer_is_unwrapped(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.core.optimizer import LightningOptimizer
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = LightningOptimizer(inner)
    assert unwrap_optimizer(wrapped) is inner
    with pytest.raises(TypeError, match="optimizer"):
        sw.watch(model, object(), run_dir=tmp_path)
