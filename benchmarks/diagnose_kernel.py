"""GPU: memory a first launch allocates, compiled-kernel resources (registers, spills, shared and
global scratch memory) and the host cost of a launch, for both statistics kernels (tile and general).

    python benchmarks/diagnose_kernel.py
"""
from __future__ import annotations

import time

import torch

from stabilitywatch.kernels import stats_triton
from stabilitywatch.stats.layout import init_row_tensor


def main() -> None:
    for kernel, dtype, n, direct in (
            ("tile", torch.bfloat16, 1 << 20, True), ("tile", torch.bfloat16, 1 << 20, False),
            ("general", torch.bfloat16, 1000, True), ("general", torch.bfloat16, 1000, False),
            ("tile", torch.bfloat16, (1 << 20) + 100, True), ("tile", torch.float32, 1 << 20, True),
            ("tile", torch.float16, 1 << 20, True), ("tile", torch.float8_e4m3fn, 1 << 20, True)):
        kernel_tune = {"kernel": kernel, "direct": direct}
        x = torch.randn(n, device="cuda").to(dtype)
        row = init_row_tensor("cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        stats_triton.launch_row_stats(x, row, 1.0, kernel_tune)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        t0 = time.perf_counter()
        for _ in range(1000):
            stats_triton.launch_row_stats(x, row, 1.0, kernel_tune)
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        print(f"{kernel} {dtype} n={n} direct={direct}: first launch allocated {peak / 2**20:.1f} MiB; host {host:.1f} us/launch")
    from stabilitywatch.kernels.stats_tile import _tile_stats_kernel
    for name, k in (("tile", _tile_stats_kernel), ("general", stats_triton._row_stats_kernel)):
        for dev_cache in k.device_caches.values():
            for key, ck in list(dev_cache[0].items()):
                md = ck.metadata
                print(name, {a: getattr(md, a, None) for a in ("num_warps", "shared",
                      "global_scratch_size", "global_scratch_align", "profile_scratch_size")},
                      "regs", getattr(ck, "n_regs", None), "spills", getattr(ck, "n_spills", None))


def small_tensor_gpu_time() -> None:
    """GPU time per tensor (kernel durations from torch.profiler) for small tensors, as a
    training step sees them: many different tensors, launched back to back."""
    from torch.profiler import ProfilerActivity, profile
    for n in (1000, 4096, 65536, 1 << 19):
        xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(100)]
        rows = init_row_tensor("cuda", rows=100)
        for i in range(100):
            stats_triton.launch_row_stats(xs[i], rows[i])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for i in range(100):
                stats_triton.launch_row_stats(xs[i], rows[i])
            torch.cuda.synchronize()
        gpu = sum(e.self_device_time_total for e in p.key_averages() if "stats" in e.key)
        print(f"bf16 n={n} ({2 * n / 2**20:.3g} MiB): GPU {gpu / 100:.1f} us per tensor")


if __name__ == "__main__":
    main()
    small_tensor_gpu_time()
