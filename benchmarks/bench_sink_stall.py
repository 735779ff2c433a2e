"""How long training waits on the sinks per step, with a sink that never returns.

A tiny MLP trained under a real Monitor (every=1, incidents.cooldown=0, a NaN batch from step 20
on: an alert every step), sinks jsonl + console + a plug-in sink whose log() hangs (and, second
run, one that takes 50 ms per call). Measured on the training thread: the time spent inside
the SinkRunner's log() and alert() per step (what the monitor hands the sinks), and the whole
step. `python benchmarks/bench_sink_stall.py [--steps 300]`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import stabilitywatch as sw  # noqa: E402
from stabilitywatch.sinks import Sink  # noqa: E402


class Hung(Sink):
    name = "hung"

    def __init__(self, delay=None):
        self.delay, self.gate = delay, threading.Event()

    def log(self, records):
        self.gate.wait(self.delay)

    def alert(self, alert):
        pass


def run(sink, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sinks = ("jsonl", "console") + ((sink,) if sink is not None else ())
    with tempfile.TemporaryDirectory() as tmp:
        mon = sw.watch(model, opt, config=sw.Config(every=1, incidents={"cooldown": 0}, capture=(),
                                                    sinks=sw.SinkConfig(use=sinks, timeout=2.0)), run_dir=tmp)
        waited = [0.0]

        def timed(f):
            def call(*a):
                t0 = time.perf_counter()
                f(*a)
                waited[0] += time.perf_counter() - t0
            return call

        mon.sinks.log, mon.sinks.alert = timed(mon.sinks.log), timed(mon.sinks.alert)
        g = torch.Generator().manual_seed(1)
        per_step, step_time = [], []
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            if step >= 20:
                x[0, 0] = float("nan")
            waited[0] = 0.0
            t0 = time.perf_counter()
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.zero_grad()
            step_time.append(time.perf_counter() - t0)
            per_step.append(waited[0])
        t0 = time.perf_counter()
        mon.close()
        closing = time.perf_counter() - t0
        if sink is not None:
            sink.gate.set()
    per_step.sort()
    step_time.sort()
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))] * 1e3  # noqa: E731
    return {"median": q(per_step, 0.5), "p99": q(per_step, 0.99), "max": per_step[-1] * 1e3,
            "step_median": q(step_time, 0.5), "step_max": step_time[-1] * 1e3,
            "close": closing, "alerts": len(mon.alerts)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    logging.getLogger("stabilitywatch").setLevel(logging.CRITICAL + 1)  # no alert lines
    rows = [("jsonl+console", run(None, args.steps)),
            ("+ a sink whose log() hangs", run(Hung(), args.steps)),
            ("+ a sink taking 50 ms per log()", run(Hung(0.05), args.steps))]
    print(f"{args.steps} steps; ms spent in the sink runner's log()+alert() per step, and "
          f"the step")
    print("| sinks | median | p99 | max | step median | step max | close (s) | alerts |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['median']:.3f} | {r['p99']:.3f} | {r['max']:.3f} | "
              f"{r['step_median']:.1f} | {r['step_max']:.1f} | {r['close']:.2f} | {r['alerts']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
