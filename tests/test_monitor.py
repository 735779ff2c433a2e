import json
import os
import sys
import logging
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g) for _ in range(n)]


def train(model, opt, mon, xs, start=0):
    for step, x in enumerate(xs, start):
        ctx = mon.step(step, batch=x) if mon else _Null()
        with ctx:
            loss = model(x).square().mean()
            loss.backward()
            if mon:
                mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def cfg(**kw):
    return sw.Config(**{"every": 1, "sinks": ("jsonl",), **kw})


def test_rows_for_every_role_and_same_numbers_as_tensor_stats(tmp_path):
    model, opt = make()
    seen = {}
    model.fc2.register_forward_hook(lambda m, a, o: seen.update(fc2=o.detach().clone()))
    mon = sw.watch(model, opt, config=cfg(), run_dir=tmp_path)
    train(model, opt, mon, batches(1))
    mon.close()
    recs = read_jsonl(tmp_path / "stats.jsonl")
    keys = {(r["module"], r["tensor"]) for r in recs}
    for m in ("fc1", "fc2", "fc3"):
        for role in ("output", "grad_output", "weight", "bias", "grad", "grad.bias",
                     "optim.exp_avg", "optim.exp_avg_sq", "optim.exp_avg.bias"):
            assert (m, role) in keys, (m, role)
    assert ("", "loss") in keys and ("", "input") in keys and ("", "grad_norm") in keys
    assert ("act", "output") not in keys  # parameter-free modules are not watched by default
    rec = next(r for r in recs if (r["module"], r["tensor"]) == ("fc2", "output"))
    want = sw.tensor_stats(seen["fc2"])
    for k in ("numel", "absmax", "min", "max", "zeros", "nan"):
        assert rec["stats"][k] == want[k], k
    assert rec["stats"]["mean"] == pytest.approx(want["mean"], rel=1e-12)
    assert rec["stats"]["std"] == pytest.approx(want["std"], rel=1e-9)
    grads = [r for r in recs if r["tensor"] in ("grad", "grad.bias")]
    gn = next(r for r in recs if r["tensor"] == "grad_norm")["stats"]["l2norm"]
    assert gn == pytest.approx(math.sqrt(sum(r["stats"]["l2norm"] ** 2 for r in grads)))


def test_monitoring_does_not_change_training(tmp_path):
    m1, o1 = make()
    m2, o2 = make()
    xs = batches(6)
    train(m1, o1, None, xs)
    with sw.watch(m2, o2, config=cfg(roles=tuple(sw.Role)), run_dir=tmp_path) as mon:
        train(m2, o2, mon, xs)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def _hook_counts(model, opt):
    mods = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in model.modules())
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                 for p in model.parameters())
    optim = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return mods, params, optim


@pytest.mark.parametrize("with_opt", [True, False], ids=["optimizer", "no-optimizer"])
def test_close_detaches_everything_and_is_idempotent(tmp_path, with_opt):
    model, opt = make()
    before = _hook_counts(model, opt)
    mon = sw.watch(model, opt if with_opt else None, config=cfg(), run_dir=tmp_path)
    assert _hook_counts(model, opt) != before
    train(model, opt, mon, batches(2))
    mon.close()
    mon.close()
    assert _hook_counts(model, opt) == before
    with pytest.raises(RuntimeError, match="closed"):
        with mon.step(5):
            pass


def test_context_manager_closes_on_exception(tmp_path):
    model, opt = make()
    before = _hook_counts(model, opt)
    with pytest.raises(ZeroDivisionError):
        with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
            with mon.step(0, batch=None):
                model(torch.randn(2, 8)).sum().backward()
                1 / 0
    assert mon.closed and _hook_counts(model, opt) == before
    steps = {r["step"] for r in read_jsonl(tmp_path / "stats.jsonl")}
    assert steps == {0}  # the step that raised was still flushed


def test_nan_names_first_module_not_downstream(tmp_path):
    model, opt = make()

    def poison(mod, args, out):
        if poison.on:
            out = out.clone()
            out[0, 0] = float("nan")
            return out
    poison.on = False
    model.fc2.register_forward_hook(poison)
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        for step, x in enumerate(batches(6)):
            poison.on = step == 3
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    crit = [a for a in mon.alerts if a.severity == sw.Severity.CRITICAL]
    assert crit and crit[0].detector == "nonfinite"
    assert (crit[0].step, crit[0].module, crit[0].tensor) == (3, "fc2", "output")
    assert "first appear in fc2 output" in crit[0].message
    lines = read_jsonl(tmp_path / "alerts.jsonl")
    assert lines[0]["module"] == "fc2" and lines[0]["severity"] == "critical"
    # later steps (NaN weights everywhere) give no new critical alert: one episode
    assert len(crit) == 1


def test_nan_in_one_gradient_names_that_gradient(tmp_path):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        for step, x in enumerate(batches(4)):
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                if step == 2:
                    model.fc2.weight.grad[1, 1] = float("inf")
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    crit = [a for a in mon.alerts if a.severity == sw.Severity.CRITICAL]
    assert [(a.step, a.module, a.tensor, a.stat) for a in crit] == [(2, "fc2", "grad", "inf")]


def test_nan_in_batch_is_blamed_on_the_batch(tmp_path):
    model, opt = make()
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        with mon.step(0, batch={"x": x}):
            model(x).sum().backward()
    a = mon.alerts[0]
    assert (a.module, a.tensor, a.severity.value) == ("", "input", "critical")
    assert "batch" in a.message


@dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
    ids: torch.Tensor


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return {"pair": (y, y * 2), "out": Out(y + 1, y.double(), torch.zeros(2, dtype=torch.long))}


def test_container_outputs(tmp_path):
    model = Multi()
    with sw.watch(model, config=cfg(modules=("lin", "")), run_dir=tmp_path) as mon:
        with mon.step(0):
            model(torch.randn(3, 4))
    roles = {r["tensor"] for r in read_jsonl(tmp_path / "stats.jsonl") if r["module"] == ""}
    assert roles == {"output.pair.0", "output.pair.1", "output.out.logits", "output.out.aux"}


def test_micro_batches_merge_and_schedule(tmp_path):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(every=3, warmup=0), run_dir=tmp_path) as mon:
        for step in range(5):
            with mon.step(step):
                for x in batches(2, seed=step):  # gradient accumulation: two micro-batches
                    loss = model(x).square().mean()
                    loss.backward()
                    mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    recs = read_jsonl(tmp_path / "stats.jsonl")
    out_steps = sorted({r["step"] for r in recs if r["tensor"] == "output"})
    assert out_steps == [0, 3]
    assert sorted({r["step"] for r in recs if r["tensor"] == "loss"}) == [0, 1, 2, 3, 4]
    fc1 = next(r for r in recs if (r["module"], r["tensor"], r["step"]) == ("fc1", "output", 0))
    assert fc1["stats"]["numel"] == 2 * 16 * 32  # both micro-batches
    g = next(r for r in recs if (r["module"], r["tensor"], r["step"]) == ("fc1", "grad", 0))
    assert g["stats"]["numel"] == 32 * 8  # the accumulated gradient, counted once
    loss = next(r for r in recs if (r["tensor"], r["step"]) == ("loss", 0))
    assert loss["stats"]["numel"] == 2


@pytest.mark.parametrize("extra", [{}, {"shadow_every": 1, "shadow": {"model": True},
                                      "output_logits": ("fc3",)}], ids=["plain", "shadow"])
@pytest.mark.parametrize("capture", [(), ("warning",)], ids=["capture-off", "capture-on"])
def test_no_host_sync_inside_monitored_step(tmp_path, monkeypatch, capture, extra):
    """On the CPU, any .item()/.tolist()/bool()/numpy()/nonzero() inside hooks is a bug that would
    sync on a GPU: make them raise from the start of a step to the end of its body. With capture
    on, the start takes the snapshot, and a flagged step writes a bundle (after the step: writing
    may sync)."""
    model, opt = make()
    mon = sw.watch(model, opt, config=cfg(roles=tuple(sw.Role),
                                          capture={"triggers": capture, "snapshot": "every"},
                                          formats={"output": "e4m3"},
                                          **extra),  # extra: shadow replicas, logits taps
                   run_dir=tmp_path)
    names = ("item", "tolist", "__bool__", "numpy", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(name):
        def f(*a, **k):
            frame = sys._getframe(1)
            while frame is not None:  # only calls made from stabilitywatch's own code count
                if f"{os.sep}stabilitywatch{os.sep}" in frame.f_code.co_filename:
                    raise AssertionError(f"host sync: Tensor.{name} called by stabilitywatch "
                                         f"({frame.f_code.co_filename}:{frame.f_lineno})")
                frame = frame.f_back
            return saved[name](*a, **k)
        return f
    for step, x in enumerate(batches(3)):
        if step == 2:
            x = x * 1e4           # E4M3 overflow in every output: an alert, and a capture
        ctx = mon.step(step, batch=x)
        for n in names:   # from the step start on: batch and weight taps, the snapshot
            monkeypatch.setattr(torch.Tensor, n, boom(n))
        with ctx:
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, boom(n))
            try:
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
            finally:
                for n in names:
                    monkeypatch.setattr(torch.Tensor, n, saved[n])
    mon.close()
    assert mon.frames_seen == 3 and not mon.taps._failed
    if extra:
        assert not mon.extras.shadow.failed and not mon.extras.logits.failed
        assert {"shadow", "shadow.model", "logz"} <= {
            r["tensor"] for r in read_jsonl(tmp_path / "stats.jsonl")}
    if capture:
        assert not mon.capture.snap.disabled and mon.capture.snap.skipped == 0
        assert [a.capture for a in mon.alerts if a.step == 2][0] == "captures/step00000002-rank0"


def test_range_detector_overflow_underflow_and_quiet_when_healthy(tmp_path):
    model, opt = make()
    scale = {"v": 1.0}
    model.fc2.register_forward_hook(lambda m, a, o: o * scale["v"])
    config = cfg(formats={"output": "e4m3"})
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step, x in enumerate(batches(9)):
            scale["v"] = {4: 1e4, 7: 1e-7}.get(step, 1.0)
            with mon.step(step, batch=x):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    got = [(a.step, a.detector, a.module, a.tensor) for a in mon.alerts]
    assert (4, "overflow", "fc2", "output") in got
    assert (7, "underflow", "fc2", "output") in got
    assert all(a.step in (4, 7) for a in mon.alerts), got
    assert all(a.module in ("fc2", "fc3") for a in mon.alerts), got


def test_failing_sink_dir_does_not_stop_training(tmp_path, caplog):
    bad = tmp_path / "file"
    bad.write_text("not a directory")
    model, opt = make()
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        with sw.watch(model, opt, config=cfg(), run_dir=bad) as mon:
            train(model, opt, mon, batches(3))
    assert mon.frames_seen == 3
    assert any("stabilitywatch" in r.getMessage() for r in caplog.records)


def test_unsupported_and_outside_step_tensors_are_ignored(tmp_path):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        model(torch.randn(2, 8))         # outside a step: nothing recorded
        mon.observe_loss(torch.tensor(1.0))
        with mon.step(0, batch={"ids": torch.arange(4), "x": torch.randn(2, 8)}):
            model(torch.randn(2, 8)).sum().backward()
    recs = read_jsonl(tmp_path / "stats.jsonl")
    assert {r["step"] for r in recs} == {0}
    assert [r["tensor"] for r in recs if r["module"] == ""].count("input") == 1  # ids skipped


def test_bad_step_argument(tmp_path):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        with pytest.raises(TypeError, match="step must be an int"):
            with mon.step("3"):
                pass


# -- step numbers: repeats, steps going backwards and nested blocks warn once each --------------

def _step_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "mon.step(" in r.getMessage()]


def _one_step(mon, model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    mon.observe_loss(loss)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("order, kind, needle", [
    ([0, 1, 1, 2, 2], "repeat", "mon.step(1) repeats step 1"),
    ([0, 5, 3, 4, 1], "backwards", "mon.step(3) comes after step 5: step numbers go backwards"),
], ids=["repeated", "backwards"])
def test_step_numbers_that_repeat_or_go_backwards_warn_once(tmp_path, caplog, order, kind, needle):
    model, opt = make()
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
            for step, x in zip(order, batches(len(order))):
                with mon.step(step, batch=x):
                    _one_step(mon, model, opt, x)
    warned = _step_warnings(caplog)
    assert len(warned) == 1 and needle in warned[0], warned
    assert mon.frames_seen == len(order) and not mon.taps._failed   # every step recorded
    steps = [r["step"] for r in read_jsonl(tmp_path / "stats.jsonl") if r["tensor"] == "loss"]
    assert steps == order


def test_nested_step_joins_the_outer_step_and_warns_once(tmp_path, caplog):
    model, opt = make()
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
            for step, x in enumerate(batches(3)):
                with mon.step(step, batch=x):
                    with mon.step(100 + step) as inner:     # a usage slip: steps do not nest
                        assert inner is mon
                        loss = model(x).square().mean()
                        loss.backward()
                    mon.observe_loss(loss)                    # after the inner block: still step
                    opt.step()
                    opt.zero_grad()
    warned = _step_warnings(caplog)
    assert len(warned) == 1, warned
    assert "mon.step(100) was entered inside the block of step 0" in warned[0]
    recs = read_jsonl(tmp_path / "stats.jsonl")
    assert sorted({r["step"] for r in recs}) == [0, 1, 2]     # no step 100..102
    for step in range(3):
        keys = {(r["module"], r["tensor"]) for r in recs if r["step"] == step}
        # the inner block's forward/backward and the outer block's optimizer step, one step
        assert {("fc2", "output"), ("fc2", "grad_output"), ("fc2", "grad"),
                ("fc2", "optim.exp_avg"), ("", "loss"), ("", "input")} <= keys
    assert mon.frames_seen == 3


def test_observe_loss_of_a_non_tensor_warns_once(tmp_path, caplog):
    model, opt = make()
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
            for step, x in enumerate(batches(2)):
                with mon.step(step, batch=x):
                    loss = model(x).square().mean()
                    loss.backward()
                    mon.observe_loss(loss.item())
                    mon.observe_loss(None)                    # no loss this step: quiet
                    opt.step()
                    opt.zero_grad()
    warned = [r.getMessage() for r in caplog.records if "observe_loss" in r.getMessage()]
    assert len(warned) == 1 and "float" in warned[0], warned
