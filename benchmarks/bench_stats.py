"""Statistics of one tensor: our Triton kernel vs the eager pure-torch reference vs the
torch.compile'd reference vs the read-once floor, all measured in the same run.

    python benchmarks/bench_stats.py                  # GPU: sizes 2^10..2^28, bf16/fp32/e4m3
    python benchmarks/bench_stats.py --variants       # GPU: kernel variants on 256 MiB tensors
    python benchmarks/bench_stats.py --smoke          # CPU: tiny sizes (the test suite runs this)

The floor is the tensor's bytes over the read bandwidth of a 1 GiB float32 torch.sum measured at
the start of the run. GPU times are medians of triton.testing.do_bench (L2 flushed between runs),
and in the sizes table also of the kernels' own time (gpu_time: the profiler's, L2 flushed too),
which leaves out the ~3-5 us of launch and event overhead that do_bench adds to every call: at
the sizes of a training step's tensors that overhead is a third of do_bench's figure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stabilitywatch.kernels.dispatch import flat_view  # noqa: E402
from stabilitywatch.stats.layout import init_row_tensor  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn}


def make(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    x = torch.randn(n, device=device) * torch.exp(torch.randn(n, device=device))
    return x.to(dtype)


def timer(device: str):
    if device == "cuda":
        import triton.testing as tt
        return lambda fn: tt.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us

    def cpu(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return cpu


def kernel_fn(x: torch.Tensor, tuning=None, timing=None):
    from stabilitywatch.kernels.stats_triton import launch_row_stats
    row = init_row_tensor(x.device)
    flat = flat_view(x)
    if timing is not None:
        from stabilitywatch.kernels._timing import launch_timed
        return lambda: launch_timed(flat, row, timing, tuning)
    return lambda: launch_row_stats(flat, row, 1.0, tuning)


def gpu_time(fn, reps: int = 20) -> float:
    """Median GPU time (us) of fn's kernels, from the first one's start to the last one's end
    (torch.profiler), with L2 flushed before each call as do_bench does."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for i in range(reps):
            flush.zero_()
            with record_function(f"bench_call#{i}"):
                fn()
        torch.cuda.synchronize()
    # each range is mirrored on the GPU's timeline: from its first kernel to its last
    spans = sorted(e.time_range.elapsed_us() for e in p.events()
                   if e.device_type == DeviceType.CUDA and e.name.startswith("bench_call#"))
    return spans[len(spans) // 2]


def read_bandwidth(device: str, t) -> float:
    """Bytes per microsecond of a large float32 torch.sum."""
    n = (1 << 28) if device == "cuda" else (1 << 20)
    x = torch.randn(n, device=device)
    return 4 * n / t(lambda: x.sum())


def run_sizes(a, device, t, bw) -> list[str]:
    sizes = [1 << k for k in (range(10, 29, 3) if not a.smoke else (10, 12))]
    if device == "cuda":
        sizes += [1 << 28] if (1 << 28) not in sizes else []
    compiled = None
    if device == "cuda" and not a.no_compile:
        compiled = torch.compile(reference_row, dynamic=True)
    kt = gpu_time if device == "cuda" else t  # the kernels' own time
    rows = ["| n | dtype | MiB | floor us | torch.sum us | ours us | ours / floor | torch.sum "
            "kernel us | ours kernel us | ours kernel / floor | ours / torch.sum, kernels "
            "| eager us | compiled us |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            "---:|---:|---:|"]
    for name, dt in DTYPES.items():
        for n in sizes:
            x = make(n, dt, device)
            nbytes = x.numel() * x.element_size()
            floor = nbytes / bw
            summ_fn = (lambda: x.view(torch.uint8).sum()) if dt.itemsize == 1 else (lambda: x.sum())
            summ = t(summ_fn)
            ours = t(kernel_fn(x))
            ksum, kours = kt(summ_fn), kt(kernel_fn(x))
            eager = t(lambda: reference_row(x))
            comp = t(lambda: compiled(x)) if compiled is not None else float("nan")
            rows.append(f"| 2^{n.bit_length() - 1} | {name} | {nbytes / 2**20:.3g} | {floor:.1f} | "
                        f"{summ:.1f} | {ours:.1f} | {ours / floor:.2f} | {ksum:.1f} | {kours:.1f} | "
                        f"{kours / floor:.2f} | {kours / ksum:.2f} | {eager:.1f} | {comp:.1f} |")
    return rows


def _variant(dtypes=None, timing=None, **tuning):
    """A tuning (kernels/tuning.py), timing-only switches (kernels/_timing.py) and the dtypes
    (names) it is for."""
    from stabilitywatch.kernels.tuning import Tuning
    if timing is not None:
        from stabilitywatch.kernels._timing import Timing
        timing = Timing(**timing)
    return Tuning(**tuning), timing, dtypes


def variants() -> dict:
    from stabilitywatch.kernels.constants import PART_COUNTS, PART_HIST, FastPass
    v = _variant
    return {
        "fast pass (default: bf16 words, table loads grouped, 2 loads/thread, 96-register cap, "
        "4 programs/SM, L2 prefetch 2 tiles ahead, 4 for bf16 and fp8 byte counts)": v(),
        "fast, L2 prefetch 2 tiles ahead": v(prefetch=2),
        "fast, 8 programs per SM": v(progs_per_sm=8),
        "fast, 8 programs per SM, no L2 prefetch": v(prefetch=0, progs_per_sm=8),
        "careful pass only, warp ballots": v(fast=FastPass.OFF),
        "fast, bf16 one value per lane (no words)": v(words=False),
        "fast, no register cap": v(register_cap=0),
        "fast, 1 load per thread": v(loads_per_thread=1),
        "fast, 4 loads per thread": v(loads_per_thread=4),
        "fast, one tile per program where possible": v(tiles_per_prog=1),
        "fast, 8 warps": v(num_warps=8),
        "fast, 8 warps, L2 prefetch 4 tiles ahead": v(num_warps=8, prefetch=4),
        "timing only (row wrong): fast, float32 sums within a tile": v(timing=dict(sum32=True)),
        "timing only (row wrong): fast without the histogram": v(
            timing=dict(fast_parts=int(PART_COUNTS))),
        "timing only (row wrong): fast without the threshold counts": v(
            timing=dict(fast_parts=int(PART_HIST))),
        "timing only (row wrong): fast without both": v(timing=dict(fast_parts=0)),
        "timing only (row wrong): fast without both, float32 sums": v(
            timing=dict(fast_parts=0, sum32=True)),
        "fast, L2 prefetch 4 tiles ahead": v(prefetch=4),
        "fast, 5 programs per SM": v(progs_per_sm=5),
        "fast, 6 programs per SM": v(progs_per_sm=6),
        "fast, 4 tiles per program": v(tiles_per_prog=4),
        "fast, 16 tiles per program": v(tiles_per_prog=16),
        "fast, 32 tiles per program": v(tiles_per_prog=32),
        "timing only (row wrong): no atomics into the row": v(timing=dict(row_writes=False)),
        "fast, 2 programs per SM": v(progs_per_sm=2),
        "fast, 3 programs per SM": v(progs_per_sm=3),
        "fp8 through the value pass": v(fp8_bytes=False, dtypes=("e4m3",)),
        "fp8 through the byte-count pass": v(fp8_bytes=True, dtypes=("e4m3",)),
        "fp8 bytes, timing only (row wrong): no row histogram": v(
            fp8_bytes=True, timing=dict(fast_parts=int(PART_COUNTS)), dtypes=("e4m3",)),
        "fp8 bytes, timing only (row wrong): no scalar fields": v(
            fp8_bytes=True, timing=dict(fast_parts=int(PART_HIST)), dtypes=("e4m3",)),
        "fp8 bytes, timing only (row wrong): no epilogue": v(
            fp8_bytes=True, timing=dict(fast_parts=0), dtypes=("e4m3",)),
        "fp8 bytes, 1 program per SM": v(fp8_bytes=True, progs_per_sm=1, dtypes=("e4m3",)),
        "fp8 bytes, 2 programs per SM": v(fp8_bytes=True, progs_per_sm=2, dtypes=("e4m3",)),
        "fp8 bytes, 1 program per SM, 8 warps": v(fp8_bytes=True, progs_per_sm=1, num_warps=8,
                                                  dtypes=("e4m3",)),
        "fp8 bytes, 2 programs per SM, 8 warps": v(fp8_bytes=True, progs_per_sm=2, num_warps=8,
                                                   dtypes=("e4m3",)),
        "fp8 bytes, 1 program per SM, 8 warps, prefetch 8": v(
            fp8_bytes=True, progs_per_sm=1, num_warps=8, prefetch=8, dtypes=("e4m3",)),
        "fp8 bytes, 2 programs per SM, 2 loads per thread": v(
            fp8_bytes=True, progs_per_sm=2, loads_per_thread=2, dtypes=("e4m3",)),
    }


def _row(x, tuning=None, timing=None):
    row = init_row_tensor(x.device)
    kernel_fn(x, tuning, timing)()
    return row


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # every field bit for bit but the float64 sums, whose atomic merge order varies (the
    # shifted sum, SUM - n K, to 1e-12 of sqrt(n * SUMSQ) + n |K|)
    from stabilitywatch.stats.layout import Stat
    sums = [int(Stat.SUM), int(Stat.SUMSQ), int(Stat.SHIFT_SUMSQ)]
    s1 = int(Stat.SHIFT_SUM)
    keep = torch.ones_like(a, dtype=torch.bool)
    keep[sums + [s1]] = False
    n = float(a[Stat.NUMEL])
    bound = 1e-12 * ((n * float(a[Stat.SUMSQ])) ** 0.5 + n * abs(float(a[Stat.SHIFT])))
    return bool(torch.equal(a[keep], b[keep])
                and torch.allclose(a[sums], b[sums], rtol=1e-12, atol=0)
                and abs(float(a[s1]) - float(b[s1])) <= bound)


def run_variants(device, t, bw, match=(), dtypes=(), mib=256) -> list[str]:
    rows = ["| variant | dtype | ours us | floor us | ours / floor | row as default |",
            "|---|---|---:|---:|---:|---|"]
    for name, dt in DTYPES.items():
        if dtypes and name not in dtypes:
            continue
        x = make((mib << 20) // dt.itemsize, dt, device)
        floor = mib * 2**20 / bw
        want = _row(x)
        for i, (vname, (tuning, timing, for_dtypes)) in enumerate(variants().items()):
            if match and i and not any(m in vname for m in match):
                continue
            if for_dtypes and name not in for_dtypes:
                continue
            try:
                us = t(kernel_fn(x, tuning, timing))
            except RuntimeError as e:  # a variant that cannot launch (resources)
                rows.append(f"| {vname} | {name} | failed: {str(e)[:60]} | | | |")
                continue
            same = "-" if timing is not None else str(_same(_row(x, tuning, timing), want))
            rows.append(f"| {vname} | {name} | {us:.1f} | {floor:.1f} | {us / floor:.2f} | "
                        f"{same} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--match", default="", help="--variants: only those whose name contains one "
                   "of these ;-separated strings (and the default)")
    p.add_argument("--dtypes", default="", help="--variants: ;-separated, e.g. bf16;fp32")
    p.add_argument("--mib", default="256", help="--variants: tensor sizes in MiB, ;-separated")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    t = timer(device)
    bw = read_bandwidth(device, t)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"# bench_stats on {name}: read bandwidth {bw / 1e3:.3f} GB/ms (TB/s) from torch.sum")
    split = lambda v: tuple(x for x in v.split(";") if x)  # noqa: E731
    if a.variants:
        rows = []
        for mib in split(a.mib):
            rows += [f"\n{mib} MiB:"] + run_variants(device, t, bw, split(a.match),
                                                    split(a.dtypes), int(mib))
    else:
        rows = run_sizes(a, device, t, bw)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
