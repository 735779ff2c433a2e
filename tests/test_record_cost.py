"""The record path's own Python on a sampled step: the monitor's function calls per record,
counted (they do not depend on the machine's speed or load), with the statistics themselves
(the pure-torch reference standing in for the kernel launch) left out. On a GPU step of ~40 ms
each call is ~0.1-0.3 us of the training thread."""
import os
import sys

import torch
import torch.nn as nn

import stabilitywatch as sw

PKG = os.path.dirname(sw.__file__)
# the statistics themselves: what a kernel launch does on the GPU
STATS = tuple(os.path.join(PKG, *p.split("/")) for p in (
    "stats/reference.py", "stats/layout.py", "stats/scale.py", "formats.py", "stats/cpu.py",
    "stats/sentinel.py"))
LAYERS = 6


def _calls(fn) -> int:
    n = [0]

    def prof(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PKG) and not name.startswith(STATS):
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def test_a_sampled_steps_records_take_few_python_calls(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    cfg = sw.Config(every=1, sinks=(), capture=(), backend="torch")
    counts = []
    with sw.watch(model, opt, config=cfg, run_dir=tmp_path) as mon:
        for step in range(3):
            with mon.step(step):
                loss = [None]

                def forward():
                    loss[0] = model(x).square().mean()
                fwd = _calls(forward)
                bwd = _calls(loss[0].backward)
                opt.step()
                opt.zero_grad()
            counts.append((fwd, bwd))
    keys = set(mon.buffer.keys)
    assert {(str(k), r) for k in range(LAYERS) for r in ("output", "grad_output")} <= keys
    fwd, bwd = counts[-1]   # a step whose slots and hooks exist already
    # per module: the forward hook, its output's row and its gradient hook's registration; the
    # backward: the gradient hook and its row (34 and 21 calls with the dynamo-disabled
    # wrappers entered and every check made per call)
    assert fwd / LAYERS <= 24, counts
    assert bwd / LAYERS <= 16, counts
