"""What the default config costs on the steps it does not sample (GPU):

    python benchmarks/diagnose_unsampled.py [--steps 8] [--smoke]

The GPT-2-small-shaped model of bench_overhead, once without a monitor and once with the default
config. For each, after warm-up, `--steps` unsampled steps run back to back (no sync between
them, as in training) under torch.profiler. Printed: the GPU span of the window per step, the
kernels' busy time per step, and every kernel or copy whose count or time per step differs
between the two (the monitor's own work on unsampled steps).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

import stabilitywatch as sw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import build, shapes, train_step  # noqa: E402


def _profile(mon_cfg, first: int, steps: int, out: str, smoke: bool):
    from torch.profiler import ProfilerActivity, profile
    model, opt, batch = build(shapes(smoke), "cpu" if smoke else "cuda")
    mon = sw.watch(model, opt, config=mon_cfg, run_dir=out) if mon_cfg else None
    for i in range(first):
        train_step(model, opt, batch, mon, i)
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    sync()
    act = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
    with profile(activities=act) as p:
        for i in range(first, first + steps):
            train_step(model, opt, batch, mon, i)
        sync()
    if mon:
        mon.close()
    want = torch.autograd.DeviceType.CPU if smoke else torch.autograd.DeviceType.CUDA
    kern = [e for e in p.events() if e.device_type == want]
    t0 = min(e.time_range.start for e in kern)
    t1 = max(e.time_range.end for e in kern)
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in kern:
        per[e.name][0] += 1
        per[e.name][1] += e.time_range.elapsed_us()
    busy = sum(v[1] for v in per.values())
    return (t1 - t0) / steps, busy / steps, per


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model: CPU operators instead "
                   "of kernels (checks the script)")
    a = p.parse_args(argv)
    # after warm-up (steps 0..9 all sampled), steps between two sampled ones (every=10)
    first = 11 if a.smoke else 41
    if not 1 <= a.steps <= 9:
        p.error("--steps: 1 to 9 (the steps between two sampled ones)")
    with tempfile.TemporaryDirectory() as tmp:
        span0, busy0, k0 = _profile(None, first, a.steps, tmp, a.smoke)
        span1, busy1, k1 = _profile(sw.Config(sinks=("jsonl",)), first, a.steps, tmp,
                                     a.smoke)
    n = a.steps
    print(f"per step, us: span none {span0:.0f}, default {span1:.0f} ({span1 - span0:+.0f}); "
          f"kernel busy none {busy0:.0f}, default {busy1:.0f} ({busy1 - busy0:+.0f})")
    rows = []
    for name in set(k0) | set(k1):
        c0, t0 = k0.get(name, (0, 0.0))
        c1, t1 = k1.get(name, (0, 0.0))
        if c0 != c1 or abs(t1 - t0) / n > 5:
            rows.append(((t1 - t0) / n, (c1 - c0) / n, name[:90]))
    rows.sort(key=lambda r: -abs(r[0]))
    print("| us/step (default - none) | launches/step | kernel |\n|---:|---:|---|")
    for dt, dc, name in rows[:30]:
        print(f"| {dt:+.1f} | {dc:+.2f} | {name} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
