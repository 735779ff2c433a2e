"""Cost of shadow replicas on the demo model (2-block GPT, d=64, batch 8 x 32, bf16 autocast):
ms per monitored step and peak memory, with statistics every step and shadows on every step.

python benchmarks/bench_shadow.py [--steps 30] [--device cpu|cuda]
Each configuration runs in its own process (peak RSS on the CPU is per process); the table's
last column is the time of a shadow step over the same step without shadows."""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "stats every step, no shadow": {},
    "+ teacher-forced fp32 shadows (16 modules)": {"shadow_every": 1},
    "+ whole-model fp32 shadow as well": {"shadow_every": 1, "shadow": {"model": True}},
    "+ teacher-forced fp64 shadows": {"shadow_every": 1, "shadow": {"dtype": "fp64"}},
}


def one(name: str, steps: int, device: str) -> dict:
    import torch
    from stabilitywatch import Config
    from stabilitywatch.demo import run_demo
    torch.set_num_threads(1)
    cfg = Config(every=1, sinks=("jsonl",), formats={"output": "e4m3"}, **CONFIGS[name])
    run_demo(tempfile.mkdtemp(), device=device, steps=3, fault_step=10**6, config=cfg)  # warm-up
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    r = run_demo(tempfile.mkdtemp(), device=device, steps=steps, fault_step=10**6, config=cfg)
    ms = (time.perf_counter() - t) * 1e3 / steps
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"name": name, "ms": ms, "peak_mib": peak, "alerts": len(r.alerts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.device)))
        return
    rows = []
    for name in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(a.steps),
                              "--device", a.device], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    mem = "peak GPU MiB" if a.device == "cuda" else "peak RSS MiB"
    print(f"| configuration | ms/step | x no-shadow | {mem} | + MiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f}x | "
              f"{r['peak_mib']:.0f} | {r['peak_mib'] - base['peak_mib']:+.0f} |")


if __name__ == "__main__":
    main()
