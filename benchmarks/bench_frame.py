"""CPU time to process one step's frame (derived values, detectors, records for the sinks) on the
frame processing thread (stabilitywatch/processing.py), for the row set of a GPT-2-small-shaped
model without running the model: sampled frames (76 watched modules x 8 roles = 608 rows, the
loss, the sentinel of its 149 parameter gradients) and unsampled ones (the loss and the
sentinel), nine of them after each sampled one as with the default cadence; per frame and per
stage (each detector, the incidents, the capture decision, the records), the processing
thread's own CPU time (time.thread_time).

    python benchmarks/bench_frame.py [--frames 30] [--sinks jsonl|none] [--smoke]

Also prints the JSONL sink's encoding time per frame, and the time of a tiny torch op in the
training thread while a sink's thread takes frames (the GIL they share): `--latency
jsonl,wandb,tensorboard`.
"""
from __future__ import annotations

import argparse
import collections
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

import numpy as np
import torch

import stabilitywatch as sw
from stabilitywatch.demo import TinyGPT
from stabilitywatch.kernels.dispatch import compute_row
from stabilitywatch.sinks import SinkRunner, jsonl
from stabilitywatch.sinks.factory import make_sinks
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.sentinel import SentinelFrame

ROLES = ["output", "grad_output", "weight", "bias", "grad", "grad.bias", "optim.exp_avg",
         "optim.exp_avg_sq"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=30)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--sinks", choices=["jsonl", "none"], default="jsonl",
                   help="none: no sink thread competing for the GIL")
    p.add_argument("--latency", default="jsonl",
                   help="sinks (comma-separated: jsonl, wandb, tensorboard) whose thread's effect "
                        "on the training thread's torch calls is measured (wandb: offline)")
    a = p.parse_args(argv)
    a.latency = [n for n in a.latency.split(",") if n]
    dims = (256, 64, 2, 4, 32) if a.smoke else (50304, 768, 12, 12, 1024)
    frames = 4 if a.smoke else a.frames
    model = TinyGPT(*dims)  # never run: only its module and parameter names matter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)   # the physics detector judges weights
    rng = np.random.default_rng(0)
    row = compute_row(torch.randn(4096)).numpy()
    loss_row = compute_row(torch.tensor([3.0])).numpy()
    with tempfile.TemporaryDirectory() as tmp:
        sinks = () if a.sinks == "none" else ("jsonl",)
        mon = sw.watch(model, optimizer=opt, config=sw.Config(sinks=sinks), run_dir=tmp)
        keys = [(n, r) for n, _ in mon.modules for r in ROLES]
        grads = list(mon.sentinel.keys)
        stages = collections.defaultdict(list)   # label -> [(frame kind, ms)]
        now = {"kind": None}
        _time_stages(mon, now)
        handle = mon._handle

        def timed_handle(frame):   # the processing thread's own CPU time for the frame
            now["acc"] = collections.defaultdict(float)
            t0 = time.thread_time()
            handle(frame)
            now["ms"] = (time.thread_time() - t0) * 1e3
            for label, ms in now["acc"].items():   # two detectors may share a name: summed
                stages[label].append((now["kind"], ms))

        mon._handle = timed_handle
        times = {"sampled": [], "unsampled": []}
        for i in range(frames):
            for kind in ("sampled",) + ("unsampled",) * 9:   # the default cadence: 1 step in 10
                step = len(times["sampled"]) + len(times["unsampled"])
                frame = (_sampled(step, keys, row, loss_row, grads, rng) if kind == "sampled"
                         else _unsampled(step, loss_row, grads, rng))
                now["kind"] = kind
                mon.processor.submit([frame])   # on the processing thread, as in training
                mon.processor.wait_all()
                times[kind].append(now.pop("ms"))
        sampled_frame = _sampled(0, keys, row, loss_row, grads, rng)
        records = mon._records(sampled_frame)
        mon.close()
    print(f"| frame | rows | sentinel gradients | frames | sinks | CPU ms per frame (median, "
          f"second half) |\n|---|---:|---:|---:|---|---:|")
    for kind, rows_n in (("sampled", len(keys) + 1), ("unsampled", 1)):
        steady = times[kind][len(times[kind]) // 2:]  # once the detectors' windows are full
        print(f"| {kind} | {rows_n} | {len(grads)} | {len(times[kind])} | {a.sinks} | "
              f"{statistics.median(steady):.3f} |")
    print("\n| stage | sampled frame, CPU ms (median, second half) | unsampled frame |\n"
          "|---|---:|---:|")
    for label, v in stages.items():
        cols = []
        for kind in ("sampled", "unsampled"):
            got = [t for k, t in v if k == kind]
            got = got[len(got) // 2:]
            cols.append(f"{statistics.median(got):.3f}" if got else "")
        print(f"| {label} | {cols[0]} | {cols[1]} |")
    # the JSONL sink's own thread per frame (holding the GIL): the records as parts for its
    # writer process, pickled for the pipe; then what the writer process spends encoding them,
    # column-wise as it does, and value by value
    send = min(timeit.repeat(lambda: pickle.dumps(("lines", jsonl.to_parts(records)),
                                                  protocol=pickle.HIGHEST_PROTOCOL),
                             number=3, repeat=7)) / 3
    print(f"JSONL sink's thread per sampled frame (parts for the writer process, pickled): "
          f"{send * 1e3:.2f} ms (min of 7 x 3)")
    for name, fn in (("column-wise", lambda: jsonl.encode_records(records)),
                     ("value by value", lambda: "".join(jsonl._dumps(jsonl._clean_record(r)) + "\n"
                                                        for r in records))):
        best = min(timeit.repeat(fn, number=3, repeat=7)) / 3  # the least disturbed run
        print(f"JSONL writer process, encoding one sampled frame {name}: {best * 1e3:.2f} ms "
              f"(min of 7 x 3)")
    if not a.smoke:
        for name in a.latency:
            print(op_latency(records, name))
    return 0


def _sampled(step, keys, row, loss_row, grads, rng) -> StatsFrame:
    # a clean run: activations, gradients and optimizer state vary, weights stay put (a weight
    # that moves more than its optimizer allows is the physics detector's critical alert)
    jitter = 1 + 0.01 * rng.random((len(keys), 1))
    jitter[[i for i, (_, r) in enumerate(keys) if r in ("weight", "bias")]] = 1.0
    rows = np.tile(row, (len(keys), 1)) * jitter
    rows = np.vstack([rows, loss_row * (1 + 0.01 * rng.random())])
    return StatsFrame(step=step, keys=keys + [("", "loss")], rows=rows,
                      scales=[1.0] * (len(keys) + 1),
                      phases=[Phase.FORWARD] * len(keys) + [Phase.LOSS],
                      sentinel=_sentinel(step, grads, rng))


def _unsampled(step, loss_row, grads, rng) -> StatsFrame:
    return StatsFrame(step=step, keys=[("", "loss")],
                      rows=(loss_row * (1 + 0.01 * rng.random()))[None, :], scales=[1.0],
                      phases=[Phase.LOSS], sentinel=_sentinel(step, grads, rng))


def _sentinel(step, grads, rng) -> SentinelFrame:
    n = len(grads)
    return SentinelFrame(step=step, keys=grads, nonfinite=np.zeros(n), absmax=rng.random(n),
                         sumsq=rng.random(n), present=np.ones(n, dtype=bool), nan=np.zeros(n),
                         numel=np.full(n, 4096.0))


def _time_stages(mon, now: dict) -> None:
    """Each stage's CPU time (time.thread_time) in the frame in progress, by stage label."""
    stage = mon.processor.stage

    def timed(label, fn, *args, **kw):
        t0 = time.thread_time()
        try:
            return stage(label, fn, *args, **kw)
        finally:
            now["acc"][label] += (time.thread_time() - t0) * 1e3

    mon.processor.stage = timed


def op_latency(records: list, sink: str = "jsonl") -> str:
    """The training thread's view of a sink's thread: tiny torch ops (each releases and re-takes
    the GIL, as every op of a training step does) run until the sink's thread has taken four
    frames; against the same ops with the sink idle, the training time lost per frame."""
    x = torch.zeros(16)

    def ops(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        return (time.perf_counter() - t0) / n * 1e6

    idle = min(ops(2000) for _ in range(5))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("WANDB_MODE", "offline")
        (made,) = make_sinks(sw.Config(sinks=(sink,)), Path(tmp), 0, 1)
        runner = SinkRunner([made])
        runner.log(records)  # start the sink (files, processes, a W&B run) first
        runner.flush(timeout=120)
        done = threading.Event()
        t0 = time.perf_counter()
        for _ in range(4):
            runner.log(records)
        threading.Thread(target=lambda: (runner.flush(timeout=600), done.set())).start()
        n = 0
        while not done.is_set():
            for _ in range(100):
                x.add_(1.0)
            n += 100
        elapsed = (time.perf_counter() - t0) * 1e6
        runner.close()
    lost = (elapsed - n * idle) / 4 / 1e3
    return (f"{sink}: the sink's thread took 4 frames in {elapsed / 1e3:.0f} ms; meanwhile a tiny "
            f"torch op took {elapsed / n:.1f} us (idle {idle:.1f} us): the training thread lost "
            f"{lost:.1f} ms per frame")


if __name__ == "__main__":
    sys.exit(main())
