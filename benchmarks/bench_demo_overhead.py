"""Step time of the demo model with and without the monitor, in one run (CPU or GPU).

    python benchmarks/bench_demo_overhead.py [--device cpu|cuda] [--steps 40] [--repeats 3]

Prints a markdown table of the median ms/step per configuration and the ratio to the
unmonitored baseline measured in the same run. No fault is injected (fault step past the end).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch

from stabilitywatch import Config
from stabilitywatch.demo import run_demo

CONFIGS = {
    "no monitor": None,
    "default config (every 10)": Config(sinks=("jsonl",)),
    "every step, default roles": Config(every=1, sinks=("jsonl",)),
    "every step, all roles": Config.preset("full", sinks=("jsonl",)),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.repeats = 3, 1
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        run_demo(f"{tmp}/warm", device=a.device, steps=2, fault_step=10**9, monitor=False)
        for r in range(a.repeats):  # interleave configurations so drift hits all alike
            for name, cfg in CONFIGS.items():
                res = run_demo(f"{tmp}/{r}-{len(times[name])}", device=a.device, steps=a.steps,
                               fault_step=10**9, monitor=cfg is not None, config=cfg)
                times[name].append(res.ms_per_step)
    base = statistics.median(times["no monitor"])
    print(f"| configuration ({a.device}, {a.steps} steps x {a.repeats}) | ms/step | ratio |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
