"""GPU: which part of the monitor raises peak memory on the GPT-2-small-shaped model.

    python benchmarks/diagnose_memory.py
"""
from __future__ import annotations

import gc
import sys
import tempfile

import torch
import torch.nn as nn

import stabilitywatch as sw

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_overhead as bo  # noqa: E402

CASES = {
    "loss only (hooks attached, nothing read)": dict(module_types=(nn.Linear,), roles=(sw.Role.LOSS,)),
    "outputs, triton": dict(module_types=(nn.Linear,), roles=(sw.Role.OUTPUT,)),
    "outputs, torch reference": dict(module_types=(nn.Linear,), roles=(sw.Role.OUTPUT,),
                                     backend="torch"),
    "outputs, blocks only (no head)": dict(modules=("blocks.*",), module_types=(nn.Linear,),
                                           roles=(sw.Role.OUTPUT,)),
    "weights only": dict(module_types=(nn.Linear,), roles=(sw.Role.WEIGHT,)),
}


def main() -> None:
    s = bo.shapes(False)
    s["steps"], s["warm"] = 3, 2
    base_ms, base_mem = bo.run("no monitor", s, "cuda", "/tmp/x")
    print(f"| case | ms/step | peak MiB | +MiB |\n|---|---:|---:|---:|\n| none | {base_ms:.1f} | "
          f"{base_mem:.0f} | 0 |")
    for name, kw in CASES.items():
        gc.collect()
        torch.cuda.empty_cache()
        cfg = sw.Config(every=1, sinks=("jsonl",), **kw)
        bo.full_coverage = lambda cfg=cfg: cfg
        with tempfile.TemporaryDirectory() as tmp:
            ms, mem = bo.run("full coverage, every step", s, "cuda", tmp)
        print(f"| {name} | {ms:.1f} | {mem:.0f} | {mem - base_mem:+.0f} |")


if __name__ == "__main__":
    main()
