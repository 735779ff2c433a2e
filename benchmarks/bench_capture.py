"""Cost of keeping start-of-step state for capture, on the demo model (CPU or CUDA).

    python benchmarks/bench_capture.py [--device cpu|cuda] [--steps 40] [--repeats 5] [--takes 200]

Measures, in one run:
- one snapshot (`Snapshotter.take`: parameters, buffers and AdamW state copied into a ring slot,
  RNG states, batch reference): host time, and on CUDA the device time between two events;
- memory held by the ring (capture_ring=2) next to the model's and optimizer's own;
- writing one bundle (safetensors + manifest + checksums, fsync'd);
- demo ms/step with capture off / on, every step sampled (a snapshot every step) and with the
  default cadence (every 10: a snapshot on 13 of 40 steps), interleaved, median of repeats.
Prints a markdown table last. No fault is injected (fault step past the end).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stabilitywatch import Config
from stabilitywatch.capture.policy import SnapshotTarget
from stabilitywatch.capture.snapshot import Snapshotter
from stabilitywatch.capture.writer import write_bundle
from stabilitywatch.demo import build_model, make_batch, run_demo, train_step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def snapshot_cost(device: str, takes: int, target: SnapshotTarget) -> dict:
    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = make_batch(torch.Generator().manual_seed(1), device)
    train_step(model, batch).backward()       # create the optimizer state, as in training
    opt.step()
    opt.zero_grad(set_to_none=True)
    snap = Snapshotter(model, opt, ring=2, target=target)
    host, dev = [], []
    for i in range(takes + 5):
        _sync(device)
        if device == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        snap.take(i, batch, seq=i)
        t1 = time.perf_counter()
        if device == "cuda":
            e1.record()
            e1.synchronize()
            dev.append(e0.elapsed_time(e1))
        snap.release_through(i)
        if i >= 5:                            # the first takes allocate the ring
            host.append((t1 - t0) * 1e3)
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        slot = snap.slots[0]
        snap.take(0, batch, seq=0)
        path = write_bundle(Path(tmp), "bench", {"kind": "bench"},
                            {"model": slot.model, "optimizer": slot.optim,
                             "batch": {k: v for k, v in batch.items()}, "rng": {}})
        write_ms = (time.perf_counter() - t0) * 1e3
        size = sum(f.stat().st_size for f in path.iterdir())
    return {"host_ms": statistics.median(host), "device_ms": statistics.median(dev) if dev else None,
            "ring_bytes": snap.nbytes, "param_bytes": state, "optim_bytes": optim,
            "write_ms": write_ms, "bundle_bytes": size,
            "on_host": any(not t.is_cuda for t in snap.slots[0].model.values())}


CONFIGS = {
    "every step, capture off": Config(every=1, sinks=("jsonl",), capture=()),
    "every step, capture on (snapshot every step)": Config(every=1, sinks=("jsonl",)),
    "default cadence (every 10), capture off": Config(sinks=("jsonl",), capture=()),
    "default cadence (every 10), capture on": Config(sinks=("jsonl",)),
}


def main(argv=None) -> list:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--takes", type=int, default=200)
    p.add_argument("--target", choices=[t.value for t in SnapshotTarget], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.repeats, a.takes = 1, 1, 3
    snap = snapshot_cost(a.device, a.takes, SnapshotTarget(a.target))
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        run_demo(f"{tmp}/warm", device=a.device, steps=2, fault_step=10**9, monitor=False)
        for r in range(a.repeats):   # interleaved, so that drift in machine load hits all alike
            for name, cfg in CONFIGS.items():
                res = run_demo(f"{tmp}/{r}-{len(times[name])}", device=a.device, steps=a.steps,
                               fault_step=10**9, config=cfg)
                times[name].append(res.ms_per_step)
    mb = 1 / 2**20
    where = "cpu" if a.device == "cpu" else ("pinned host" if snap["on_host"] else "device")
    print(f"snapshot ({a.device}, target {a.target} -> {where} memory):"
          f" {snap['host_ms']:.3f} ms host" + (f", {snap['device_ms']:.3f} ms device"
                                               if snap["device_ms"] is not None else ""))
    print(f"ring allocated: {snap['ring_bytes'] * mb:.2f} MiB; parameters {snap['param_bytes'] * mb:.2f}"
          f" MiB, optimizer state {snap['optim_bytes'] * mb:.2f} MiB; one bundle "
          f"{snap['bundle_bytes'] * mb:.2f} MiB written in {snap['write_ms']:.1f} ms")
    print()
    print(f"| configuration ({a.device}, {a.steps} steps x {a.repeats}) | ms/step (median) | "
          f"capture on / off |")
    print("|---|---:|---:|")
    names = list(CONFIGS)
    rows = []
    for i, name in enumerate(names):
        m = statistics.median(times[name])
        base = statistics.median(times[names[i - 1]]) if i % 2 else None
        rows.append({"config": name, "ms": m, "ratio": m / base if base else None, **snap})
        print(f"| {name} | {m:.1f} | {f'{m / base:.3f}x' if base else ''} |")
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
