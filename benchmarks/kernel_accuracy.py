"""Accuracy of the statistics kernel's SUM and SUMSQ (and so of mean and std) on large tensors.

For fp32 and bf16 inputs and three distributions — randn, randn + 1000 (cancellation in the
std), and wide log-normal magnitudes with random signs — the kernel's row is compared with
exact float64 values: every fp32/bf16 value and its square are exact in float64, so math.fsum
(correctly rounded) gives the reference SUM and SUMSQ; the reference std is two-pass
(fsum of (x - mean)^2). The pure-torch reference row (the CPU path) is measured alongside as
the baseline. Errors are relative, computed in float64; std is derived from the row exactly as
the hooks derive it (stabilitywatch.stats.derive).

On CUDA the compiled kernel runs (default n = 10^8). Without CUDA the kernel runs under
TRITON_INTERPRET=1, set here before triton is imported; the interpreter takes about 1 s per
10^6 elements (about 100 s per 10^8 tensor, over 10 min for the six cases), so the CPU default
is n = 10^7. --smoke runs n = 10^5.

    python benchmarks/kernel_accuracy.py [--n N] [--smoke] [--out table.md]
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stabilitywatch.stats.derive import derive  # noqa: E402
from stabilitywatch.stats.layout import Stat  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DISTS = ("randn", "randn+1000", "lognormal")
_CHUNK = 1 << 20


def make(dist: str, n: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, device=device, generator=g)
    if dist == "randn+1000":
        x += 1000.0
    elif dist == "lognormal":  # magnitudes e^(4 z): about 2^-23 .. 2^23 at 4 sigma
        sign = torch.randint(0, 2, (n,), device=device, generator=g) * 2 - 1
        x = torch.exp(4 * torch.randn(n, device=device, generator=g)) * sign
    elif dist != "randn":
        raise ValueError(dist)
    return x.to(dtype)


def fsum(a: np.ndarray, f=lambda c: c) -> float:
    """Correctly rounded sum of f(a) for a float64 array (math.fsum, chunk by chunk)."""
    return math.fsum(itertools.chain.from_iterable(
        f(a[i:i + _CHUNK]).tolist() for i in range(0, a.size, _CHUNK)))


def exact_stats(x: torch.Tensor) -> dict[str, float]:
    a = x.detach().float().cpu().numpy().astype(np.float64)
    s = fsum(a)
    q = fsum(a, lambda c: c * c)  # squares of fp32/bf16 values are exact in float64
    mean = s / a.size
    centred = fsum(a, lambda c: (c - mean) ** 2)
    return {"sum": s, "sumsq": q, "std": math.sqrt(centred / a.size),
            "abs_sum": float(np.abs(a).sum())}


def rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else abs(got - want)


def run_kernel(x: torch.Tensor, reps: int) -> tuple[np.ndarray, float]:
    from stabilitywatch.kernels.stats_triton import triton_row

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    triton_row(x[:4096])  # compile / warm up outside the timing
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        row = triton_row(x)
        sync()
        times.append(time.perf_counter() - t0)
    return row.cpu().numpy(), float(np.median(times))


def errors(row: np.ndarray, ex: dict[str, float]) -> dict[str, float]:
    d = derive(row)
    return {"sum": rel(row[Stat.SUM], ex["sum"]), "sumsq": rel(row[Stat.SUMSQ], ex["sumsq"]),
            "std": rel(d["std"], ex["std"]),
            "sum_abs": abs(row[Stat.SUM] - ex["sum"]) / ex["abs_sum"]}


def measure(n: int, device: str, reps: int, log=print) -> list[dict]:
    results = []
    for (dname, dtype), dist in itertools.product(DTYPES.items(), DISTS):
        x = make(dist, n, dtype, device)
        row, secs = run_kernel(x, reps)
        ex = exact_stats(x)
        ref = errors(reference_row(x).cpu().numpy(), ex)
        results.append({"dtype": dname, "dist": dist, "n": n, "seconds": secs,
                        **{f"kernel_{k}": v for k, v in errors(row, ex).items()},
                        **{f"ref_{k}": v for k, v in ref.items()}})
        log(f"  done {dname} {dist} ({secs:.3g} s)", file=sys.stderr)
        del x
    return results


def table(results: list[dict], device: str) -> str:
    lines = [f"Kernel SUM/SUMSQ accuracy vs exact (math.fsum) float64, on {device}; "
             "relative errors; 'ref' = pure-torch reference row (CPU path).", "",
             "| dtype | distribution | n | rel err sum | err sum / sum abs | rel err sumsq "
             "| rel err std | ref: rel err std | kernel wall time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["seconds"]
        tstr = f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.1f} s"
        lines.append(f"| {r['dtype']} | {r['dist']} | {r['n']:.0e} | {r['kernel_sum']:.2e} | "
                     f"{r['kernel_sum_abs']:.2e} | {r['kernel_sumsq']:.2e} | {r['kernel_std']:.2e} "
                     f"| {r['ref_std']:.2e} | {tstr} |")
    return "\n".join(lines)


def main(argv: "list[str] | None" = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=float, default=None,
                   help="elements per tensor (default 1e8 on CUDA, 1e7 on the CPU interpreter)")
    p.add_argument("--smoke", action="store_true", help="n = 1e5, one repetition")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    n = int(1e5 if args.smoke else args.n or (1e8 if cuda else 1e7))
    reps = args.reps or (1 if args.smoke or not cuda else 10)
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "CPU, TRITON_INTERPRET=1"
    results = measure(n, device, reps)
    text = table(results, name)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
