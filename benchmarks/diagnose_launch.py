"""GPU: where the host time of one statistics launch goes (cProfile over 2000 launches of a
small tensor, and the bare pieces timed alone).

    python benchmarks/diagnose_launch.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from stabilitywatch.kernels import stats_triton
from stabilitywatch.stats.layout import init_row_tensor


def per_call(fn, n=2000) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def main() -> None:
    x = torch.randn(1000, device="cuda").to(torch.bfloat16)
    row = init_row_tensor("cuda")
    y = torch.empty(1, device="cuda")
    print(f"torch add_ (one tiny kernel): {per_call(lambda: y.add_(1)):.1f} us")
    from stabilitywatch.stats.buffer import StatsBuffer
    buf = StatsBuffer()
    buf.begin_step(0)
    small = [torch.randn(768, device="cuda") for _ in range(100)]
    print(f"StatsBuffer.add, 768 fp32: {per_call(lambda: buf.add(small[0], 'm', 'w', 1)):.1f} us")
    items = [(t, f"m{i}", "w", 1.0) for i, t in enumerate(small)]
    print(f"StatsBuffer.add_many, 100 x 768 fp32: "
          f"{per_call(lambda: buf.add_many(items, 1), n=200) / 100:.1f} us per tensor")
    print(f"launch_row_stats n=1000: {per_call(lambda: stats_triton.launch_row_stats(x, row)):.1f} us")
    print(f"x.view(int16): {per_call(lambda: x.view(torch.int16)):.2f} us")
    print(f"data_ptr: {per_call(lambda: x.data_ptr()):.2f} us")
    print(f"raw stream: {per_call(lambda: torch._C._cuda_getCurrentRawStream(0)):.2f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        stats_triton.launch_row_stats(x, row)
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14)
    print(out.getvalue()[-3500:])


if __name__ == "__main__":
    main()
