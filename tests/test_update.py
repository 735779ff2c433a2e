"""Optimizer update statistics: rows of role optim.update (dW = W_after - W_before) on sampled
steps, ||dW|| / ||W|| per module in stats.jsonl, and the update detector (a warning only for a
real jump)."""
import json
import math

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw


def _run(tmp_path, steps, lr_at=None, every=2, opt_name="adamw"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if opt_name == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    seen = {}
    cfg = sw.Config(every=every, warmup=0, sinks=("jsonl",), escalate_steps=0)
    with sw.watch(model, opt, config=cfg, run_dir=tmp_path) as mon:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = (1e-3 if opt_name == "adamw" else 1e-2) * (
                    100.0 if step == lr_at else 1.0)
            x = torch.randn(16, 8, generator=g)
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                before = [p.detach().clone() for p in model[0].parameters()]
                opt.step()
                opt.zero_grad()
                seen[step] = (math.sqrt(sum(float((p.detach() - b).double().square().sum())
                                            for p, b in zip(model[0].parameters(), before))),
                              math.sqrt(sum(float(b.double().square().sum()) for b in before)))
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    return mon, recs, seen


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_update_rows_and_ratio_on_sampled_steps(tmp_path, opt_name):
    mon, recs, seen = _run(tmp_path, 6, opt_name=opt_name)
    ratios = {r["step"]: r["stats"] for r in recs
              if r["tensor"] == "update_ratio" and r["module"] == "0"}
    assert sorted(ratios) == [0, 2, 4]           # sampled steps only
    for step, st in ratios.items():
        du, w = seen[step]
        assert st["update_l2norm"] == pytest.approx(du, rel=1e-5)
        assert st["weight_l2norm"] == pytest.approx(w, rel=1e-6)
        assert st["update_ratio"] == pytest.approx(du / w, rel=1e-5)
    roles = {(r["module"], r["tensor"]) for r in recs if r["step"] == 2}
    assert {("0", "optim.update"), ("0", "optim.update.bias")} <= roles
    assert not [a for a in mon.alerts if a.stat == "update_ratio"]


def test_update_detector_warns_on_a_jump_only(tmp_path):
    mon, _, _ = _run(tmp_path / "clean", 60)
    assert not [a for a in mon.alerts if a.stat == "update_ratio"]
    mon, _, _ = _run(tmp_path / "jump", 40, lr_at=30)
    got = [a for a in mon.alerts if a.stat == "update_ratio"]
    assert got and {a.step for a in got} == {30}
    assert {a.module for a in got} == {"0", "2"} and all(a.severity.value == "warning"
                                                          for a in got)
    assert got[0].detector == "spike" and got[0].tensor == "optim.update"
