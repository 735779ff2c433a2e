"""Where the monitor's overhead on the GPT-2-small-shaped model comes from (GPU):

    python benchmarks/diagnose_overhead.py

1. host cost of one kernel launch (wall clock of 2000 launches on a small tensor, no sync);
2. step time and peak memory with one role at a time, every step;
3. the top CUDA kernels of a full-coverage step (torch.profiler).
"""
from __future__ import annotations

import sys
import tempfile
import time

import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.kernels.dispatch import accumulate
from stabilitywatch.stats.layout import init_row_tensor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_overhead import run, shapes  # noqa: E402


def launch_cost() -> None:
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    row = init_row_tensor("cuda")
    for _ in range(20):
        accumulate(x, row)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        accumulate(x, row)
    host = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    gpu = (time.perf_counter() - t0) / 2000 * 1e6
    print(f"launch: host {host:.1f} us per accumulate() call, wall incl. GPU {gpu:.1f} us")


def roles() -> None:
    s = shapes(False)
    s["steps"], s["warm"] = 6, 3
    base_ms, base_mem = run("no monitor", s, "cuda", "/tmp/x")
    print(f"| roles (every step) | ms/step | +ms | peak MiB | +MiB |\n|---|---:|---:|---:|---:|")
    print(f"| none | {base_ms:.1f} | 0 | {base_mem:.0f} | 0 |")
    import bench_overhead as bo
    for role in (sw.Role.OUTPUT, sw.Role.GRAD_OUTPUT, sw.Role.WEIGHT, sw.Role.GRAD, sw.Role.OPTIM):
        cfg = sw.Config(every=1, module_types=(nn.Linear,), roles=(role,), sinks=("jsonl",))
        bo.full_coverage = lambda cfg=cfg: cfg
        with tempfile.TemporaryDirectory() as tmp:
            ms, mem = run("full coverage, every step", s, "cuda", tmp)
        print(f"| {role.value} | {ms:.1f} | {ms - base_ms:+.1f} | {mem:.0f} | {mem - base_mem:+.0f} |")


def profile() -> None:
    import bench_overhead as bo
    s = shapes(False)
    s["steps"], s["warm"] = 2, 2
    bo.full_coverage = lambda: sw.Config(every=1, module_types=(nn.Linear,), sinks=("jsonl",),
                                          roles=(sw.Role.OUTPUT, sw.Role.GRAD_OUTPUT))
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        with tempfile.TemporaryDirectory() as tmp:
            run("full coverage, every step", s, "cuda", tmp)
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    launch_cost()
    roles()
    profile()
