"""Print the zoo's table for tests/zoo/README.md: python tests/zoo/table.py"""
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import scenarios  # noqa: E402
from test_zoo import FAULTS  # noqa: E402

EVENT = {"e4m3_outlier_growth": "first E4M3 overflow", "lr_spike": "loss spike alert",
         "attention_logit_growth": "loss divergence (loss spike alert)"}


def main() -> None:
    torch.set_num_threads(1)
    print("| scenario | fault step | first warning (step: detector module role stat) | "
          "detection delay | harm step | lead time | run time |")
    print("|---|---:|---|---:|---|---:|---:|")
    for name in FAULTS + ["clean_run"]:
        t = time.perf_counter()
        run = getattr(scenarios, name)(tempfile.mkdtemp())
        secs = time.perf_counter() - t
        if name == "clean_run":
            print(f"| {run.name} | - | none ({len(run.alerts)} info alerts) | - | - | - | "
                  f"{secs:.1f} s |")
            continue
        a = run.loud[0]
        harm = run.event_step if run.event_step is not None else run.fault_step
        what = EVENT.get(name, "the fault itself")
        print(f"| {run.name} | {run.fault_step} | {a.step}: {a.detector} {a.module or '<model>'} "
              f"{a.tensor} {a.stat} | {a.step - run.fault_step} | {harm} ({what}) | "
              f"{harm - a.step} | {secs:.1f} s |")


if __name__ == "__main__":
    main()
