"""What the taps cost on steps that read nothing but the loss and the sentinel: the forward hooks
answer before entering their eager (dynamo-disabled) wrapper."""
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.hooks import taps as _taps


def test_forward_hooks_enter_their_wrapper_only_on_steps_that_read_the_forward(tmp_path,
                                                                                monkeypatch):
    entered = []
    wrap = _taps._eager

    def counting(fn):
        inner = wrap(fn)
        if fn.__name__ != "eager":        # the forward hooks' body; gradient hooks are others
            return inner

        def call(*args):
            entered.append(args[0])
            return inner(*args)
        return call
    monkeypatch.setattr(_taps, "_eager", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_step = {}
    with sw.watch(model, opt, config=sw.Config(every=4, warmup=0, sinks=()),
                  run_dir=tmp_path) as mon:
        for step in range(8):
            before = len(entered)
            with mon.step(step):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            per_step[step] = len(entered) - before
    watched = len(mon.modules)
    assert watched == 2
    assert per_step == {s: watched if s % 4 == 0 else 0 for s in range(8)}, per_step
