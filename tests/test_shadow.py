"""Shadow replicas: the numbers, the isolation (weights, RNG, autograd, buffers), the schedule."""
import json
import math

import numpy as np

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.shadow import ulp_of


class Net(nn.Module):
    def __init__(self, dropout=0.0, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(8, 64)
        self.drop = nn.Dropout(dropout)
        self.bn = nn.BatchNorm1d(64) if bn else nn.Identity()
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.bn(self.drop(torch.relu(self.fc1(x)))))


def cfg(**kw):
    return sw.Config(**{"every": 1, "sinks": ("jsonl",), "shadow_every": 1, **kw})


def run(tmp_path, config, steps=4, autocast=False, seed=0, monitor=True, **net):
    torch.manual_seed(seed)
    model = Net(**net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    mon = sw.watch(model, opt, config=config, run_dir=tmp_path) if monitor else None
    draws = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        ctx = mon.step(step, batch=x) if mon else _Null()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x).float().square().mean()
            loss.backward()
            if mon:
                mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        draws.append(torch.rand(1))  # the global RNG stream after each step
    if mon:
        mon.close()
    return model, mon, torch.cat(draws)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def records(tmp_path, tensor="shadow"):
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    return [r for r in recs if r["tensor"] == tensor]


@pytest.mark.parametrize("net", [{}, {"dropout": 0.3}, {"bn": True}], ids=["plain", "dropout", "bn"])
def test_shadow_changes_nothing_in_training(tmp_path, net):
    m1, _, d1 = run(tmp_path / "a", None, monitor=False, autocast=True, **net)
    m2, mon, d2 = run(tmp_path / "b", cfg(shadow={"model": True}), autocast=True, **net)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n   # weights, BatchNorm running stats
    assert torch.equal(d1, d2)        # the RNG stream
    assert not mon.extras.shadow.failed and not mon.extras.shadow.handles
    assert records(tmp_path / "b")


def test_bf16_errors_match_a_direct_computation(tmp_path):
    seen = {}
    torch.manual_seed(0)
    model = Net()
    model.fc1.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    with sw.watch(model, config=cfg(modules=("fc1",)), run_dir=tmp_path) as mon:
        with mon.step(0):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(32, 8))
    ref = torch.nn.functional.linear(seen["x"].double(), model.fc1.weight.double(),
                                     model.fc1.bias.double())
    err = seen["y"].double() - ref
    rec = records(tmp_path)[0]
    assert rec["module"] == "fc1" and seen["y"].dtype == torch.bfloat16
    st = rec["stats"]
    # the replica runs in fp32, the check in fp64: agree to fp32 rounding
    assert st["rel_l2"] == pytest.approx((err.norm() / ref.norm()).item(), rel=1e-3)
    assert 1e-4 < st["rel_l2"] < 1e-2
    assert st["sqnr_db"] == pytest.approx(-20 * math.log10(st["rel_l2"]), rel=1e-9)
    cos = torch.nn.functional.cosine_similarity(seen["y"].double().flatten(), ref.flatten(), 0)
    assert st["cosine"] == pytest.approx(cos.item(), abs=1e-7)
    assert st["max_abs_err"] == pytest.approx(err.abs().max().item(), rel=1e-3)
    assert st["max_ulp"] >= 0.5 and st["mean_ulp"] < st["max_ulp"]
    assert not [a for a in mon.alerts if a.severity.value != "info"]


def test_fp64_shadow_of_fp32_model_is_near_exact(tmp_path):
    run(tmp_path, cfg(shadow={"dtype": "fp64"}), steps=2)
    recs = records(tmp_path)
    assert {r["module"] for r in recs} == {"fc1", "fc2"}
    for r in recs:
        # max ULP is large where outputs nearly cancel (tiny |y|); the mean stays near 1
        assert r["stats"]["rel_l2"] < 1e-6 and r["stats"]["mean_ulp"] < 16, r


def test_dropout_masks_are_replayed(tmp_path):
    run(tmp_path, cfg(modules=("fc1", "fc2"), shadow={"modules": ("",)}), dropout=0.5,
        autocast=True)
    recs = records(tmp_path)
    assert recs and all(r["stats"]["rel_l2"] < 0.02 for r in recs)  # a new mask would give ~1


def test_shadow_schedule_and_module_selection(tmp_path):
    run(tmp_path, cfg(shadow_every=3, shadow={"modules": ("fc2",)}), steps=7)
    recs = records(tmp_path)
    assert sorted(r["step"] for r in recs) == [0, 3, 6]
    assert {r["module"] for r in recs} == {"fc2"}
    raw = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    roles = {r["tensor"] for r in raw if r["module"] == "fc2" and r["step"] == 3}
    assert {"shadow.output", "shadow.error", "shadow.ulp", "output"} <= roles
    assert "shadow.live" not in roles   # fc2 is watched: its `output` row serves


def test_unwatched_shadow_module_records_its_live_row(tmp_path):
    run(tmp_path, cfg(modules=("fc1",), shadow={"modules": ("fc2",)}), steps=1)
    raw = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    assert ("fc2", "shadow.live") in {(r["module"], r["tensor"]) for r in raw}
    assert not math.isnan(records(tmp_path)[0]["stats"]["cosine"])


def test_whole_model_shadow_gives_accumulated_error(tmp_path):
    run(tmp_path, cfg(shadow={"model": True}), steps=2, autocast=True)
    recs = records(tmp_path, "shadow.model")
    assert {r["module"] for r in recs} == {"fc1", "fc2", ""}
    fc2 = next(r for r in recs if r["module"] == "fc2" and r["step"] == 0)["stats"]
    local = next(r for r in records(tmp_path) if r["module"] == "fc2" and r["step"] == 0)["stats"]
    assert 0 < local["rel_l2"] and 0 < fc2["rel_l2"] < 0.05


def test_bad_shadow_config():
    with pytest.raises(ValueError, match=r"shadow\.dtype"):
        sw.Config(shadow={"dtype": "fp16"})
    with pytest.raises(ValueError, match=r"shadow\.rel_warn"):
        sw.Config(shadow={"rel_warn": 0.9, "rel_critical": 0.1})
    with pytest.raises(ValueError, match=r"shadow\.modules"):
        sw.watch(Net(), config=cfg(shadow={"modules": ("nope*",)}), run_dir=None)


@pytest.mark.parametrize("dtype,x,want", [
    (torch.bfloat16, 1.0, 2.0 ** -7), (torch.bfloat16, -3.0, 2.0 ** -6),
    (torch.bfloat16, 0.0, 2.0 ** -133), (torch.float16, 1e-6, 2.0 ** -24),
    (torch.float16, 65504.0, 32.0), (torch.float32, 1.0, 2.0 ** -23),
], ids=["bf16-1", "bf16-neg3", "bf16-zero", "fp16-subnormal", "fp16-max", "fp32-1"])
def test_ulp_of(dtype, x, want):
    got = ulp_of(torch.tensor([x], dtype=torch.float64), dtype)
    assert got.item() == want


@pytest.mark.parametrize("s_val,e_val,y_val", [(1e-152, 1e10, 1e-152), (1e150, 1e-5, 1e150)],
                         ids=["ratio-underflows", "ratio-overflows"])
def test_shadow_measures_of_extreme_magnitudes(s_val, e_val, y_val):
    """A shadow and error whose squared norms' ratio under- or overflows float64 give a finite
    or infinite measure, not a math error that switches the shadow stage off."""
    from stabilitywatch.shadow.metrics import shadow_metrics
    from stabilitywatch.stats.buffer import Phase, StatsFrame
    from stabilitywatch.stats.reference import reference_row

    t = {("m", "output"): torch.full((4,), y_val, dtype=torch.float64),
         ("m", "shadow.output"): torch.full((4,), s_val, dtype=torch.float64),
         ("m", "shadow.error"): torch.full((4,), e_val, dtype=torch.float64)}
    rows = np.stack([reference_row(v).numpy() for v in t.values()])
    f = StatsFrame(step=0, keys=list(t), rows=rows, scales=[1.0] * 3,
                   phases=[Phase.FORWARD] * 3)
    (_, _, _, m), = shadow_metrics(f)
    want = 10 * (2 * math.log10(s_val) - 2 * math.log10(e_val))
    assert m["sqnr_db"] == pytest.approx(want, rel=1e-9)
    assert not math.isnan(m["cosine"])
    assert m["rel_l2"] >= 0
