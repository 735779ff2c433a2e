"""The every-step gradient sentinel: kernel = twin = numpy, frames in backward order, and the
nonfinite detector naming a gradient (or the forward) on unsampled steps."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.stats.sentinel import sentinel_reference


def _expected(g: torch.Tensor) -> list:
    x = g.detach().double().reshape(-1).numpy()
    fin = np.isfinite(x)
    f = x[fin]
    return [float((~fin).sum()), float(np.abs(f).max()) if f.size else 0.0,
            float(np.sum(f * f)), float(np.isnan(x).sum())]


def _grads(dtype, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(sizes):
        t = (torch.randn(n, generator=g) * (k + 1)).to(dtype)
        if n > 3:
            t[n // 2] = float("nan")
            t[n - 1] = float("inf") if k % 2 else float("-inf")
        out.append(t)
    return out


SIZES = [1, 127, 4097, 3 * 8192 + 5, 0]


def test_huge_finite_values_keep_a_finite_sum_of_squares():
    # |x| = 2^100 is finite in float32 and bf16; its square is not: the sums are float64
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.full((300,), 2.0 ** 100).to(dtype)
        out = torch.zeros(1, 4, dtype=torch.float64)
        sentinel_reference([big], out, [0])
        assert out[0, 2].item() == pytest.approx(300 * 2.0 ** 200, rel=1e-12)
        assert out[0, 0].item() == 0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["f32", "bf16", "f16", "f64"])
def test_twin_matches_numpy(dtype):
    grads = _grads(dtype, SIZES)
    out = torch.zeros(len(grads) + 2, 4, dtype=torch.float64)
    slots = [5, 0, 2, 1, 3]
    sentinel_reference(grads, out, slots)
    for g, s in zip(grads, slots):
        exp = _expected(g)
        got = out[s].tolist()
        assert got[0] == exp[0] and got[1] == exp[1] and got[3] == exp[3], (s, got, exp)
        assert got[2] == pytest.approx(exp[2], rel=1e-12)
    assert out[4].tolist() == [0.0] * 4


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
def test_kernel_matches_twin_and_rebinds(dtype):
    from stabilitywatch.kernels.sentinel import SentinelLaunch
    grads = [g for g in _grads(dtype, SIZES) if g.numel()]
    slots = [3, 0, 2, 1]
    ref = torch.zeros(4, 4, dtype=torch.float64)
    sentinel_reference(grads, ref, slots)
    out = torch.zeros(4, 4, dtype=torch.float64)
    launch = SentinelLaunch(grads, slots, torch.device("cpu"))
    launch.run(out)
    for s in range(4):
        assert out[s, 0] == ref[s, 0] and out[s, 1] == ref[s, 1] and out[s, 3] == ref[s, 3]
        assert out[s, 2].item() == pytest.approx(ref[s, 2].item(), rel=1e-12)
    if dtype == torch.float16:
        return    # 2^100 is Inf in fp16 (its largest value's square fits in float32)
    # |x| = 2^100: finite, its square is not in float32
    big = [torch.full((300,), 2.0 ** 100).to(dtype)]
    huge = torch.zeros(1, 4, dtype=torch.float64)
    SentinelLaunch(big, [0], torch.device("cpu")).run(huge)
    assert huge[0, 2].item() == pytest.approx(300 * 2.0 ** 200, rel=1e-12)
    assert huge[0, 0].item() == 0
    # new tensors of the same sizes elsewhere: the launch takes their addresses
    other = [g.clone() * 2 for g in grads]
    assert launch.rebind([t.data_ptr() for t in other]) or any(t.data_ptr() % 16 for t in other)
    out.zero_()
    launch.run(out)
    ref.zero_()
    sentinel_reference(other, ref, slots)
    assert torch.equal(out[:, [0, 1, 3]], ref[:, [0, 1, 3]])


# -- in a monitored run -------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _run(tmp_path, steps, fault=None, config=None, optimizer=True, hook=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer else None
    g = torch.Generator().manual_seed(1)
    config = config or sw.Config(every=10, warmup=0, sinks=("jsonl",))
    with sw.watch(model, opt, config=config, run_dir=tmp_path) as mon:
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            with mon.step(step, batch=x):
                if hook is not None:
                    hook(model, step)
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                if fault is not None:
                    fault(model, step)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
                else:
                    model.zero_grad()
    return mon


def _nan_in(param_name, at):
    def fault(model, step):
        if step == at:
            p = dict(model.named_parameters())[param_name]
            p.grad.view(-1)[1] = float("nan")
    return fault


def _nan_in_backward(param_name, at):
    # without an optimizer the sentinel runs as the last gradient of backward is ready: the
    # fault goes in during backward (a gradient hook), the loop zeroes gradients in the step
    def hook(model, step):
        p = dict(model.named_parameters())[param_name]
        if step == at:
            model._ph = p.register_hook(lambda g: g.index_fill(0, torch.tensor([1]),
                                                               float("nan")))
        elif hasattr(model, "_ph"):
            model._ph.remove()
            del model._ph
    return hook


@pytest.mark.parametrize("optimizer", [True, False], ids=["optimizer", "no-optimizer"])
def test_nan_in_a_gradient_on_an_unsampled_step_is_named_at_that_step(tmp_path, optimizer):
    if optimizer:
        mon = _run(tmp_path, 5, fault=_nan_in("fc2.bias", 3))
    else:
        mon = _run(tmp_path, 5, hook=_nan_in_backward("fc2.bias", 3), optimizer=False)
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit, [a.line() for a in mon.alerts]
    a = crit[0]
    assert (a.step, a.detector, a.module, a.tensor, a.stat) == (3, "nonfinite", "fc2",
                                                              "grad.bias", "nan")
    assert a.extra["phase"] == "backward" and a.extra["source"] == "sentinel"
    # backward order: fc3's gradients were ready (and finite) before fc2's
    assert "fc3" in " ".join(a.extra["finite_before"])
    recs = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    norms = {r["step"]: r["stats"] for r in recs if r["tensor"] == "grad_norm"}
    assert sorted(norms) == [0, 1, 2, 3, 4]            # the global grad norm on every step
    assert norms[3]["nonfinite"] == 1 and norms[2]["nonfinite"] == 0
    assert all(math.isfinite(v["l2norm"]) and v["l2norm"] > 0 for s, v in norms.items() if s < 4)


def test_sentinel_frames_list_gradients_in_backward_order(tmp_path):
    mon = _run(tmp_path, 2)
    store = mon.buffer.sentinel
    keys = [store.keys[i] for i in store.order]
    assert [k[0] for k in keys] == ["fc3", "fc3", "fc2", "fc2", "fc1", "fc1"]
    assert sorted(keys) == sorted(store.keys)
    assert store.launches == 2 and not mon.sentinel.handles   # order hooks removed once known


def test_forward_inf_on_an_unsampled_step_says_forward(tmp_path):
    def hook(model, step):
        if step == 4:
            h = model.fc2.register_forward_hook(lambda m, a, o: o.index_fill(1, torch.tensor([0]),
                                                                             float("inf")))
            model._h = h
        elif hasattr(model, "_h"):
            model._h.remove()
            del model._h
    mon = _run(tmp_path, 6, hook=hook)
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit, [a.line() for a in mon.alerts]
    a = crit[0]
    assert (a.step, a.module, a.tensor) == (4, "", "loss")
    assert a.extra["phase"] == "forward" and "forward of step 4" in a.message


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_backward_only_nan_in_gpt2_is_named_at_the_first_gradient_it_reaches(tmp_path):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = "transformer.h.0.attn.c_proj"

    def poison(mod, args, out):
        def g(grad):
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
            return grad
        out.register_hook(g)
    gen = torch.Generator().manual_seed(0)
    with sw.watch(model, opt, config=sw.Config(every=10, warmup=0, sinks=("jsonl",)),
                  run_dir=tmp_path) as mon:
        for step in range(4):
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            h = dict(model.named_modules())[target].register_forward_hook(poison) \
                if step == 2 else None
            with mon.step(step, batch=ids):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
            if h is not None:
                h.remove()
    store = mon.buffer.sentinel
    order = [store.keys[i] for i in store.order]
    expected = next(k for k in order if k[0] == target)
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit, [a.line() for a in mon.alerts]
    a = crit[0]
    assert (a.step, a.module, a.tensor) == (2, *expected), a.line()
    assert a.extra["phase"] == "backward"
    # every gradient before it in backward order (the second block, lm head...) was finite
    assert order.index(expected) == a.extra["backward_index"] > 0


def test_sentinel_runs_without_host_sync(tmp_path, monkeypatch):
    """As tests/test_monitor.py's sync check, on unsampled steps where only the loss and the
    sentinel are read, with a NaN injected: no .item()/.tolist()/bool()/numpy()/nonzero() from
    stabilitywatch's code between the step start and the end of its body."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sw.watch(model, opt, config=sw.Config(every=10, warmup=0, sinks=("jsonl",)),
                   run_dir=tmp_path)
    names = ("item", "tolist", "__bool__", "numpy", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(name):
        def f(*a, **k):
            frame = sys._getframe(1)
            while frame is not None:
                if f"{os.sep}stabilitywatch{os.sep}" in frame.f_code.co_filename:
                    raise AssertionError(f"host sync: Tensor.{name} called by stabilitywatch "
                                         f"({frame.f_code.co_filename}:{frame.f_lineno})")
                frame = frame.f_back
            return saved[name](*a, **k)
        return f
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(16, 8, generator=g)
        ctx = mon.step(step, batch=x)
        for n in names:
            monkeypatch.setattr(torch.Tensor, n, boom(n))
        with ctx:
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, boom(n))
            try:
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                if step == 2:
                    with torch.no_grad():
                        model.fc1.weight.grad[0, 0] = float("inf")
                opt.step()
                opt.zero_grad()
            finally:
                for n in names:
                    monkeypatch.setattr(torch.Tensor, n, saved[n])
    mon.close()
    assert not mon.sentinel.failed and mon.buffer.sentinel.launches == 4
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert (crit[0].step, crit[0].module, crit[0].tensor, crit[0].stat) == (2, "fc1", "grad",
                                                                          "inf")


# -- the per-step path: the kept launches again, when the gradients are where they were -------
def _frame_of(store, step):
    return store.frame(store.end_step(step))


def test_write_again_rereads_the_gradients_in_place_and_refuses_moved_ones():
    from stabilitywatch.stats.sentinel_store import SentinelStore
    from stabilitywatch.stats.backend import TORCH
    params = [nn.Parameter(torch.zeros(n)) for n in SIZES if n]
    store = SentinelStore(TORCH)
    store.set_keys([("m", str(k)) for k in range(len(params))])
    assert not store.write_again(params)                 # nothing written yet
    for p, g in zip(params, _grads(torch.float32, [p.numel() for p in params])):
        p.grad = g
    store.write([(k, p.grad) for k, p in enumerate(params)])
    _frame_of(store, 0)
    for p in params:                                     # new values at the same addresses
        p.grad.mul_(3.0)
    assert store.write_again(params)
    f = _frame_of(store, 1)
    for k, p in enumerate(params):
        exp = _expected(p.grad)
        assert [f.nonfinite[k], f.absmax[k], f.nan[k]] == [exp[0], exp[1], exp[3]]
        assert f.sumsq[k] == pytest.approx(exp[2], rel=1e-12) and f.present[k]
    params[1].grad = params[1].grad.clone()              # elsewhere: the full write checks it
    assert not store.write_again(params)
    store.write([(k, p.grad) for k, p in enumerate(params)])
    assert store.write_again(params)
    params[0].grad = None                                # a missing gradient: the full write
    assert not store.write_again(params)
    store.write([(k, p.grad) for k, p in enumerate(params) if p.grad is not None])
    assert not store.write_again(params)                 # that step's rows were not every row


def test_monitored_steps_take_the_kept_launch_and_still_name_a_nan(tmp_path):
    """With gradients zeroed in place (the same addresses every step), every step after the
    first takes write_again, and a NaN on an unsampled step is still named at its step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with sw.watch(model, opt, config=sw.Config(every=10, warmup=0, sinks=("jsonl",)),
                  run_dir=tmp_path) as mon:
        store = mon.buffer.sentinel
        for step in range(6):
            x = torch.randn(16, 8, generator=g)
            with mon.step(step, batch=x):
                model(x).square().mean().backward()
                if step == 4:
                    with torch.no_grad():
                        model.fc2.bias.grad[1] = float("nan")
                opt.step()
                opt.zero_grad(set_to_none=False)
        assert store.launches == 6 and store.again == 5
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit and (crit[0].step, crit[0].module, crit[0].tensor) == (4, "fc2", "grad.bias")
