"""Cost of what capture keeps (CPU or CUDA), on the demo model or on the GPT-2-small-shaped model
of bench_overhead.py: the default policy ("auto": each step's batch reference and RNG states,
one copy of the state for a guarded incident's bundle) and the "sampled" snapshot ring.

    python benchmarks/bench_capture.py [--device cpu|cuda] [--model demo|gpt2] [--steps N]
                                       [--repeats 5] [--takes 200]

--model: demo by default on the CPU, gpt2 on CUDA (12 layers, d 768, vocab 50304, seq 1024,
batch 16, bf16 autocast, fused AdamW; bench_overhead's smoke shapes with --smoke or on the CPU).

Measures, in one run:
- what the default keeps per step (`StepRing.add`: RNG states, hyper-parameters, the batch by
  reference): host time;
- the default's one copy of the current weights and optimizer state for a bundle (`copy_state`,
  what a guarded incident costs once): wall time, to host memory;
- one snapshot of the "sampled"/"every" policies (`Snapshotter.take`: parameters, buffers and
  AdamW state copied into a ring slot): host time, and on CUDA the device time between two events;
- memory held by the ring (capture.ring=2) next to the model's and optimizer's own; gpt2: also
  next to the peak memory of a training step (CUDA), and each configuration's peak;
- writing one bundle (safetensors + manifest + checksums, fsync'd);
- ms/step with capture off, the default policy and capture.snapshot="sampled", every step sampled
  and at the default cadence (every 10), interleaved, median of repeats (demo); gpt2: mean
  ms/step over --steps (30) steps after bench_overhead's warm-up steps (10).
Prints a markdown table last. No fault is injected (fault step past the end).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stabilitywatch import Config
from stabilitywatch.capture.policy import SnapshotTarget
from stabilitywatch.capture.snapshot import Snapshotter
from stabilitywatch.capture.state import StepRing, copy_state
from stabilitywatch.capture.writer import write_bundle
from stabilitywatch.demo import build_model, make_batch, run_demo, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture_gpt2  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def demo_setup(device: str) -> tuple:
    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, opt, make_batch(torch.Generator().manual_seed(1), device), train_step


def snapshot_cost(device: str, takes: int, target: SnapshotTarget, setup=demo_setup) -> dict:
    """`setup(device)` -> (model, optimizer, batch, loss function); built here so that it is
    freed before the step-time runs, whose peak memory is read."""
    model, opt, batch, loss_fn = setup(device)
    for _ in range(2):   # the first creates the optimizer state, the second is a plain step's peak
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    snap = Snapshotter(model, opt, ring=2, target=target)
    host, dev = [], []
    for i in range(takes + 5):
        _sync(device)
        if device == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        slot = snap.take(i, batch, seq=i)
        t1 = time.perf_counter()
        if device == "cuda" and slot is not None and slot.ready is not None:
            slot.ready.synchronize()   # a host ring is filled on a side stream: time it whole
            dev.append((time.perf_counter() - t0) * 1e3)
        elif device == "cuda":
            e1.record()
            e1.synchronize()
            dev.append(e0.elapsed_time(e1))
        snap.release_through(i)
        if i >= 5:                            # the first takes allocate the ring
            host.append((t1 - t0) * 1e3)
    ring, per_step = StepRing(opt), []
    for i in range(takes + 5):
        t0 = time.perf_counter()
        ring.add(i, i, batch)
        if i >= 5:
            per_step.append((time.perf_counter() - t0) * 1e3)
        ring.release_through(i)
    names = {id(p): n for n, p in model.named_parameters()}
    _sync(device)
    t0 = time.perf_counter()
    copy_state(model, opt, names, 0, 0)
    copy_ms = (time.perf_counter() - t0) * 1e3
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        slot = snap.slots[0]
        snap.take(0, batch, seq=0)
        if slot.ready is not None:
            slot.ready.synchronize()
        path = write_bundle(Path(tmp), "bench", {"kind": "bench"},
                            {"model": slot.model, "optimizer": slot.optim,
                             "batch": {k: v for k, v in batch.items()}, "rng": {}})
        write_ms = (time.perf_counter() - t0) * 1e3
        size = sum(f.stat().st_size for f in path.iterdir())
    return {"host_ms": statistics.median(host), "device_ms": statistics.median(dev) if dev else None,
            "ring_bytes": snap.nbytes, "param_bytes": state, "optim_bytes": optim,
            "write_ms": write_ms, "bundle_bytes": size,
            "ring_add_ms": statistics.median(per_step), "copy_ms": copy_ms,
            "step_peak_bytes": step_peak, "slot_bytes": snap.slots[0].nbytes,
            "slots": len(snap.slots),
            "on_host": any(not t.is_cuda for t in snap.slots[0].model.values())}


CONFIGS = {
    "every step, capture off": Config(every=1, sinks=("jsonl",), capture=()),
    "every step, default capture (auto)": Config(every=1, sinks=("jsonl",)),
    "every step, capture.snapshot='sampled' (snapshot every step)":
        Config(every=1, sinks=("jsonl",), capture={"snapshot": "sampled"}),
    "default cadence (every 10), capture off": Config(sinks=("jsonl",), capture=()),
    "default cadence (every 10), default capture (auto)": Config(sinks=("jsonl",)),
    "default cadence (every 10), capture.snapshot='sampled'":
        Config(sinks=("jsonl",), capture={"snapshot": "sampled"}),
}
OFF = 3   # each cadence's rows: capture off, then the two policies


def demo_run(device: str, steps: int, cfg: Config, out: str) -> tuple[float, None]:
    return run_demo(out, device=device, steps=steps, fault_step=10**9, config=cfg).ms_per_step, None


def main(argv=None) -> list:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["demo", "gpt2"], default=None,
                   help="default: demo on the CPU, gpt2 on CUDA")
    p.add_argument("--steps", type=int, default=None, help="default: 40 (demo), 30 (gpt2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--takes", type=int, default=200)
    p.add_argument("--target", choices=[t.value for t in SnapshotTarget], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.repeats, a.takes = 1, 1, 3
    gpt2 = (a.model or ("gpt2" if a.device == "cuda" else "demo")) == "gpt2"
    target = SnapshotTarget(a.target)
    if gpt2:
        s = capture_gpt2.shapes(a.smoke, a.device)
        a.steps = a.steps or s["steps"]
        snap = snapshot_cost(a.device, a.takes, target, capture_gpt2.setup(s))
        run = functools.partial(capture_gpt2.run, s, a.device, a.steps)
    else:
        a.steps = a.steps or 40
        snap = snapshot_cost(a.device, a.takes, target)
        run = functools.partial(demo_run, a.device, a.steps)
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    peaks: dict[str, list] = {k: [] for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        if not gpt2:   # capture_gpt2.run warms up inside each run
            run_demo(f"{tmp}/warm", device=a.device, steps=2, fault_step=10**9, monitor=False)
        for r in range(a.repeats):   # interleaved, so that drift in machine load hits all alike
            for k, (name, cfg) in enumerate(CONFIGS.items()):
                if cfg.capture.triggers:  # --target applies to the monitored runs too
                    cfg = cfg.replace(capture={"snapshot_to": target})
                ms, peak = run(cfg, f"{tmp}/{r}-{k}")
                times[name].append(ms)
                peaks[name].append(peak)
    mb = 1 / 2**20
    if gpt2:
        dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        print(f"# bench_capture gpt2 on {dev}: {s}; {a.steps} timed steps after {s['warm']}")
    where = "cpu" if a.device == "cpu" else ("pinned host" if snap["on_host"] else "device")
    print(f"snapshot ({a.device}, target {a.target} -> {where} memory):"
          f" {snap['host_ms']:.3f} ms host" + (f", {snap['device_ms']:.3f} ms device"
                                               if snap["device_ms"] is not None else ""))
    print(f"default policy per step: {snap['ring_add_ms']:.4f} ms host (RNG states, batch "
          f"reference); one copy of the state for a bundle: {snap['copy_ms']:.1f} ms")
    print(f"ring allocated: {snap['ring_bytes'] * mb:.2f} MiB; parameters {snap['param_bytes'] * mb:.2f}"
          f" MiB, optimizer state {snap['optim_bytes'] * mb:.2f} MiB; one bundle "
          f"{snap['bundle_bytes'] * mb:.2f} MiB written in {snap['write_ms']:.1f} ms")
    if gpt2:
        print(capture_gpt2.ring_line(snap, a.device, where))
    print()
    print(f"| configuration ({a.device}, {a.steps} steps x {a.repeats}) | ms/step (median) | "
          f"capture on / off |" + (" peak MiB (max) |" if gpt2 else ""))
    print("|---|---:|---:|" + ("---:|" if gpt2 else ""))
    names = list(CONFIGS)
    rows = []
    for i, name in enumerate(names):
        m = statistics.median(times[name])
        base = statistics.median(times[names[i - i % OFF]]) if i % OFF else None
        pk = max(peaks[name]) if peaks[name][0] is not None else None
        rows.append({"config": name, "ms": m, "ratio": m / base if base else None,
                     "peak_bytes": pk, **snap})
        print(f"| {name} | {m:.1f} | {f'{m / base:.3f}x' if base else ''} |"
              + (f" {pk * mb:.0f} |" if pk is not None else " n/a |" if gpt2 else ""))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
