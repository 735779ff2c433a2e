"""Print the HF zoo's table for tests/zoo/README.md: python tests/zoo/table_hf.py [--clean]"""
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import hf_scenarios as H  # noqa: E402
from test_zoo_hf import CASES, run_steps  # noqa: E402


def fmt(e):
    if e is None:
        return "none"
    step, sev, module, role = e
    step = f"{step[0]}-{step[1]}" if isinstance(step, tuple) else step
    return f"{step} {sev} `{module or '<model>'}` `{role}`"


def main() -> None:
    torch.set_num_threads(1)
    print("| scenario | model | fault step | expected first incident | got | alerts "
          "(incidents) | run time |")
    print("|---|---|---:|---|---|---:|---:|")
    for arch, name, fault in CASES + [("gpt2", "fp16_growth", 20)]:
        steps = 46 if name == "fp16_growth" else run_steps(name, fault)
        t = time.perf_counter()
        run = H.FAULTS[name](tempfile.mkdtemp(), arch=arch, fault=fault, steps=steps)
        secs = time.perf_counter() - t
        print(f"| {run.name} | {arch} | {fault} | {fmt(run.expect)} | {fmt(run.got())} | "
              f"{len(run.alerts)} ({len(run.roots)}) | {secs:.1f} s |")
    if "--clean" in sys.argv:
        for arch in ("gpt2", "llama"):
            t = time.perf_counter()
            run = H.clean(tempfile.mkdtemp(), arch=arch)
            loud = sum(a.severity.value != "info" for a in run.alerts)
            print(f"| {run.name} | {arch} | - | no warning, <= {run.steps // 100} alerts | "
                  f"{loud} warnings | {len(run.alerts)} ({len(run.roots)}) | "
                  f"{time.perf_counter() - t:.1f} s |")


if __name__ == "__main__":
    main()
