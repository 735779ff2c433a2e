"""GPU: memory a first launch allocates, compiled-kernel resources (registers, spills, shared and
global scratch memory) and the host cost of a launch, for both statistics kernels.

    python benchmarks/diagnose_kernel.py
"""
from __future__ import annotations

import time

import torch

from stabilitywatch.kernels import stats_triton
from stabilitywatch.stats.layout import init_row_tensor


def main() -> None:
    for fast, dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32),
                        (True, torch.float16), (True, torch.float8_e4m3fn)):
        x = torch.randn(1 << 20, device="cuda").to(dtype)
        row = init_row_tensor("cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        stats_triton.launch_row_stats(x, row, 1.0, {"fast": fast})
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        t0 = time.perf_counter()
        for _ in range(1000):
            stats_triton.launch_row_stats(x, row, 1.0, {"fast": fast})
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        print(f"fast={fast} {dtype}: first launch allocated {peak / 2**20:.1f} MiB; host {host:.1f} us/launch")
    from stabilitywatch.kernels.stats_fast import _fast_stats_kernel
    for name, k in (("fast", _fast_stats_kernel), ("general", stats_triton._row_stats_kernel)):
        for dev_cache in k.device_caches.values():
            for key, ck in list(dev_cache[0].items()):
                md = ck.metadata
                print(name, {a: getattr(md, a, None) for a in ("num_warps", "shared",
                      "global_scratch_size", "global_scratch_align", "profile_scratch_size")},
                      "regs", getattr(ck, "n_regs", None), "spills", getattr(ck, "n_spills", None))


if __name__ == "__main__":
    main()
