"""A tiny real model trained under a real Monitor, with NaN batches that make critical alerts,
and plug-in sinks that hang, crawl or raise: shared by test_sinks_stuck.py and
test_sinks_disk.py (and run as a script by the latter, under a file-size limit)."""
import json
import logging
import sys
import threading
import time

import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.sinks import Sink

GATE_LIMIT = 20.0   # seconds a gated call waits at most: no test hangs past it


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CountingSink(Sink):
    """Keeps what it is handed."""
    name = "counting"

    def __init__(self):
        self.records, self.alerts = 0, []

    def log(self, records):
        self.records += len(records)

    def alert(self, alert):
        self.alerts.append(alert)


class GatedSink(CountingSink):
    """`method` blocks until the gate opens (a network call that never returns); the other
    methods work."""

    def __init__(self, name="gated", method="log"):
        super().__init__()
        self.name, self.method = name, method
        self.gate, self.entered = threading.Event(), threading.Event()

    def _wait(self):
        self.entered.set()
        self.gate.wait(GATE_LIMIT)

    def log(self, records):
        if self.method == "log":
            self._wait()
        super().log(records)

    def alert(self, alert):
        if self.method == "alert":
            self._wait()
        super().alert(alert)

    def close(self):
        if self.method == "close":
            self._wait()


class RaisingSink(CountingSink):
    """`method` raises `exc` (SystemExit, KeyboardInterrupt...) every time."""

    def __init__(self, exc, method):
        super().__init__()
        self.name, self.exc, self.method = "raising", exc, method

    def log(self, records):
        if self.method == "log":
            raise self.exc
        super().log(records)

    def alert(self, alert):
        if self.method == "alert":
            raise self.exc
        super().alert(alert)


def train(run_dir, sinks, steps=24, nan_from=6, step_bound=None, **config):
    """Trains `steps` steps (sinks: a list, or a SinkConfig); every batch from `nan_from` on
    holds a NaN (a critical alert each step, with incidents.cooldown=0). Returns (monitor, step
    times). step_bound: raise as soon as a step takes longer (so that a stalling sink fails the
    test instead of hanging it)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = sw.Config(**{"every": 1, "incidents": {"cooldown": 0}, "capture": (), "sinks": sinks,
                       **config})
    mon = sw.watch(model, opt, config=cfg, run_dir=run_dir)
    g = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        if step >= nan_from:
            x[0, 0] = float("nan")
        t0 = time.perf_counter()
        with mon.step(step, batch=x):
            loss = model(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            if step < nan_from:
                opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step_bound is not None and times[-1] > step_bound:
            raise AssertionError(f"step {step} took {times[-1]:.2f} s (bound {step_bound} s)")
    return mon, times


def read_jsonl(path):
    def reject(name):
        raise AssertionError(f"bare {name} in JSON")

    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text == "" or text.endswith("\n"), f"{path} ends on a cut line: {text[-80:]!r}"
    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def sink_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "stabilitywatch" and r.levelno == logging.WARNING
            and not r.getMessage().startswith("[stabilitywatch]")]   # not alert lines


if __name__ == "__main__":
    # python sink_scenarios.py RUN_DIR FSIZE_LIMIT: trains under RLIMIT_FSIZE (a write past the
    # limit fails with EFBIG, in this process and in its writer process alike), into
    # RUN_DIR/process (statistics written by the writer process) and RUN_DIR/thread (by the
    # sink's thread), and prints what each monitor produced, as JSON
    import resource

    run_dir, limit = sys.argv[1], int(sys.argv[2])
    torch.randn(4).sum()      # torch's lazy imports done before the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    out = {}
    for where in ("process", "thread"):
        if where == "thread":
            sys.executable = ""   # no writer process can start: the sink's thread writes
        counting = CountingSink()
        mon, _ = train(f"{run_dir}/{where}", ("jsonl", counting), steps=30, nan_from=10)
        mon.close()
        out[where] = {"alerts": [a.to_dict() for a in mon.alerts], "records": counting.records}
    print(json.dumps(out))
