"""The guard (Config.guard.on_nonfinite="skip"): a step whose gradients hold NaN/Inf is skipped on
the device (fused optimizers, found_inf) or by the documented host fallback (others), and the
weights are those of a run where that step never happened; across 2 gloo ranks both skip the
same step."""
import json
import time

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.guard import is_fused


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


OPTS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
}


def _train(tmp_path, make_opt, skip_step=None, nan_at=None, guard=True):
    model = _model()
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=g) for _ in range(6)]
    cfg = sw.Config(every=10, warmup=0, sinks=("jsonl",),
                    guard={"on_nonfinite": "skip" if guard else "warn"})
    with sw.watch(model, opt, config=cfg, run_dir=tmp_path) as mon:
        for step, x in enumerate(xs):
            if step == skip_step:
                continue
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                if step == nan_at:
                    model[2].weight.grad[1, 2] = float("nan")
                opt.step()
                opt.zero_grad()
    return model, opt, mon


@pytest.mark.parametrize("name", list(OPTS))
def test_guard_skips_the_step_and_weights_equal_a_run_without_it(tmp_path, name):
    guarded, opt, mon = _train(tmp_path / "a", OPTS[name], nan_at=3)
    clean, opt_b, _ = _train(tmp_path / "b", OPTS[name], skip_step=3)
    for (n, p), q in zip(guarded.named_parameters(), clean.parameters()):
        assert torch.isfinite(p).all(), n
        assert torch.equal(p, q), n
    for p, q in zip(guarded.parameters(), clean.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k     # Adam's step count taken back too
    assert is_fused(opt) == name.endswith("-fused")
    assert mon.control.guard.skipped_host == ([] if is_fused(opt) else [3])
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert (crit[0].step, crit[0].module, crit[0].tensor) == (3, "2", "grad")
    assert crit[0].extra["skipped"] is True and "step skipped" in crit[0].message
    assert not hasattr(opt, "found_inf")      # put back as it was after each step


def test_without_the_guard_the_nan_reaches_the_weights(tmp_path):
    model, _, mon = _train(tmp_path, OPTS["adamw-fused"], nan_at=3, guard=False)
    assert not torch.isfinite(model[2].weight).all()
    assert "skipped" not in mon.alerts[0].extra


def test_guard_combines_with_a_grad_scaler_found_inf(tmp_path):
    # GradScaler sets found_inf on fused optimizers before step(): ours is combined (max) with
    # it, and the attribute is left for GradScaler to delete
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = sw.Config(every=10, warmup=0, sinks=("jsonl",), guard={"on_nonfinite": "skip"})
    with sw.watch(model, opt, config=cfg, run_dir=tmp_path) as mon:
        with mon.step(0):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.found_inf = torch.ones(())       # the scaler found an Inf (0-dim, as its own)
            w = model[0].weight.detach().clone()
            opt.step()
            assert torch.equal(model[0].weight, w) and torch.equal(opt.found_inf, torch.ones(()))
            del opt.found_inf
            opt.zero_grad()
        with mon.step(1):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.found_inf = torch.zeros(())
            opt.step()
            assert not torch.equal(model[0].weight, w)
            del opt.found_inf
    assert not mon.alerts


def test_guard_flag_is_reduced_across_two_gloo_ranks(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    import dist_guard
    from distutil import free_port, start_ranks
    ctx = start_ranks(dist_guard.entry, (2, free_port(), str(tmp_path)), 2)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(p.is_alive() for p in ctx.processes):
        time.sleep(0.05)
    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(5)
    assert not hung, f"ranks {hung} hung"
    res = [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(2)]
    for r, x in enumerate(res):
        assert x["ok"], f"rank {r}:\n{x.get('error')}"
        assert x["unchanged_at_3"], f"rank {r} applied step 3"
    assert res[0]["weights"] == res[1]["weights"]
    # the same escalation window on both ranks, from the cross-rank flag
    assert res[0]["windows"] == res[1]["windows"] and res[0]["windows"]
    crit = [a for a in res[0]["alerts"] if a["severity"] == "critical"]
    assert crit and crit[0]["step"] == 3 and crit[0]["extra"]["skipped"] is True
    # rank 0's own gradients were finite: the flush's merged sentinel names the rank that was
    # not, and the gradient
    assert crit[0]["extra"]["ranks"] == [1] and crit[0]["rank"] == 1
    assert "[rank 1 of 2]" in crit[0]["message"]
    assert (crit[0]["module"], crit[0]["tensor"]) == ("2", "grad.bias")
