"""What the taps cost on the training thread: the forward hooks answer before doing any work on
steps that read nothing but the loss and the sentinel, and outside torch.compile's tracing no
hook enters its eager (dynamo-disabled) wrapper, whose call costs several us."""
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.hooks import taps as _taps


def _run(tmp_path, monkeypatch, model_fn=None):
    entered, wrapped, worked = [], [], []
    wrap = _taps._eager

    def counting(fn):
        inner = wrap(fn)

        def call(*args):
            entered.append(fn.__name__)
            return inner(*args)
        wrapped.append(fn.__name__)
        return call
    monkeypatch.setattr(_taps, "_eager", counting)
    on_forward = _taps.Taps._on_forward

    def counted(self, name, *args):
        worked.append(name)
        return on_forward(self, name, *args)
    monkeypatch.setattr(_taps.Taps, "_on_forward", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_step = {}
    with sw.watch(model, opt, config=sw.Config(every=4, warmup=0, sinks=()),
                  run_dir=tmp_path) as mon:
        for step in range(8):
            before = len(worked)
            with mon.step(step):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            per_step[step] = len(worked) - before
    return mon, per_step, entered, wrapped


def test_forward_hooks_work_only_on_steps_that_read_the_forward(tmp_path, monkeypatch):
    mon, per_step, _, _ = _run(tmp_path, monkeypatch)
    watched = len(mon.modules)
    assert watched == 2
    assert per_step == {s: watched if s % 4 == 0 else 0 for s in range(8)}, per_step


def test_eager_hooks_never_enter_the_dynamo_wrapper(tmp_path, monkeypatch):
    mon, per_step, entered, wrapped = _run(tmp_path, monkeypatch)
    # the wrappers exist (torch.compile's tracing takes them) and the sampled steps read the
    # outputs and their gradients, but no eager call went through a wrapper
    assert {"eager", "body"} <= set(wrapped), wrapped
    assert sum(per_step.values()) == 2 * 2
    assert entered == []
    rows = {k for k in mon.buffer.keys if k[1] in ("output", "grad_output")}
    assert {("0", "output"), ("2", "output"), ("0", "grad_output"), ("2", "grad_output")} <= rows
