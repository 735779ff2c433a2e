"""Where a configuration's extra GPU time goes on one of bench_steps.py's models: 3 profiled
steps (torch.profiler) after 20, per kernel name the time per step over the unmonitored model's.

    python benchmarks/diagnose_step_kernels.py [--model llama] [--configs "none;every=1;fixed"]
    python benchmarks/diagnose_step_kernels.py --smoke     # CPU: tiny shapes, CPU ops

Configurations as bench_steps.py names them; the first is the baseline.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_steps as B  # noqa: E402

import stabilitywatch as sw  # noqa: E402

WARM, STEPS = 20, 3


def per_name(model: str, kind: str, device: str, smoke: bool, out: str) -> tuple[dict, dict]:
    m, fwd, opt, ids = B.build(model, device, smoke)
    cfg = B.config(kind)
    mon = sw.watch(m, opt, config=cfg, run_dir=out) if cfg is not None else None
    warm = 3 if smoke else WARM
    for i in range(warm):
        B.step(fwd, opt, ids, mon, i, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as p:
        for i in range(warm, warm + STEPS):
            B.step(fwd, opt, ids, mon, i, device)
        sync()
    want = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    us, calls = collections.defaultdict(float), collections.Counter()
    for e in p.events():
        if e.device_type == want:
            name = e.name[:70]
            us[name] += (e.device_time if device == "cuda" else e.self_cpu_time_total) / STEPS
            calls[name] += 1
    if mon is not None:
        mon.close()
    return us, calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama", choices=B.MODELS)
    p.add_argument("--configs", default="none;every=1;fixed")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    smoke = a.smoke or device == "cpu"
    kinds = [k for k in a.configs.split(";") if k]
    for k in kinds:
        B.config(k)   # a bad name fails before any run
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, k in enumerate(kinds):
            res[k] = per_name(a.model, k, device, smoke, f"{tmp}/{i}")
    base = res[kinds[0]][0]
    what = "GPU kernel" if device == "cuda" else "CPU op (self)"
    for k in kinds[1:]:
        us, calls = res[k]
        diff = {n: us[n] - base.get(n, 0.0) for n in set(us) | set(base)}
        print(f"\n{a.model}, {k}: {what} time per step over {kinds[0]}'s: "
              f"{sum(diff.values()) / 1e3:.2f} ms ({kinds[0]}: {sum(base.values()) / 1e3:.2f} ms)")
        print("| name | ms per step | calls per step |")
        print("|---|---:|---:|")
        for n, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.top]:
            print(f"| {n} | {v / 1e3:.3f} | {calls[n] / STEPS:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
