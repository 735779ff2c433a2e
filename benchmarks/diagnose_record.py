"""Host time of one record, layer by layer (GPU; a CPU smoke size runs the same layers):

    python benchmarks/diagnose_record.py [--calls 3000] [--mib 1]
    python benchmarks/diagnose_record.py --step every=1 [--steps 10] [--repeats 2]

`--step CONFIG`: a sampled step of the bench_steps.py Llama by part instead (record_step.py):
each part's training-thread time with and without the monitor, its rows, the row backend's
time apart, the host time per row and the Python calls.

One bf16 tensor recorded again and again through each layer of the record path, from the
innermost out: the compiled kernel's own launcher, our direct launch (kernels/launch.py),
launch_row_stats, dispatch.accumulate, StatsBuffer.add and Monitor._record. Each layer's figure
includes the layers inside it, so the differences are what each adds. The tensor is small
enough by default (--mib) that the GPU keeps up with the host: what is timed is the host.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import stabilitywatch as sw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import config as bench_config  # noqa: E402
from stabilitywatch.kernels import dispatch
from stabilitywatch.kernels.backend import kernel_backend
from stabilitywatch.stats.buffer import Phase, StatsBuffer
from stabilitywatch.stats.layout import init_row_tensor


def _us(fn, calls: int, device: str) -> float:
    for _ in range(20):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--mib", type=int, default=1)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--step", default="", metavar="CONFIG",
                   help="instead: a sampled Llama step by part under this bench_steps.py "
                        "configuration (every=1, every=1,nocap,nosinks, ...)")
    p.add_argument("--steps", type=int, default=10, help="with --step: timed steps per run")
    p.add_argument("--repeats", type=int, default=2, help="with --step: interleaved rounds")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if a.step:
        import record_step
        bench_config(a.step)
        return record_step.main(a.step, device, device == "cpu", 2 if a.smoke else a.steps,
                                1 if a.smoke else a.repeats)
    calls = 20 if device == "cpu" else a.calls
    n = a.mib * 2**19 if device == "cuda" else 4096  # a multiple of the tile
    x = torch.randn(n, device=device).to(torch.bfloat16)
    row = init_row_tensor(device)
    layers = []
    if device == "cuda":
        from stabilitywatch.kernels import stats_tile, stats_triton
        from stabilitywatch.kernels.launch import _hooks
        stats_triton.launch_row_stats(x, row)  # compiles, fills the direct-launch cache
        (key, kernel), = stats_tile._launch.cache.items()
        # the call FastLaunch ends with, on the arguments launch_row_stats passed
        args = (x.view(torch.int16), row, row, 1.0, n)
        names = stats_tile._tile_stats_kernel.arg_names
        consts = tuple(v for k, v in key[2 + len(args):] if k in names)
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        enter, leave = _hooks()
        layers.append(("compiled launcher (kernel.run)", lambda: kernel.run(
            132, 1, 1, stream, kernel.function, kernel.packed_metadata, None, enter, leave,
            *args, *consts)))
    layers.append(("launch_row_stats", lambda: _launch_row(x, row, device)))
    layers.append(("dispatch.accumulate", lambda: dispatch.accumulate(x, row)))
    buf = StatsBuffer(kernel_backend())
    buf.begin_step(0)
    layers.append(("StatsBuffer.add", lambda: buf.add(x, "m", "output", Phase.FORWARD)))
    model = torch.nn.Linear(4, 4).to(device)
    with tempfile.TemporaryDirectory() as tmp:
        mon = sw.watch(model, config=sw.Config(sinks=(), every=1), run_dir=tmp)
        ctx = mon.step(0)
        ctx.__enter__()
        layers.append(("Monitor._record", lambda: mon._record(x, "m", "output", Phase.FORWARD,
                                                              False)))
        rows = [(name, _us(fn, calls, device)) for name, fn in layers]
        ctx.__exit__(None, None, None)
        mon.close()
    print(f"host us per record of one {x.numel()}-element bf16 tensor on {device}")
    print("| layer (includes those above) | us per call |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


def _launch_row(x, row, device):
    if device == "cuda":
        from stabilitywatch.kernels.stats_triton import launch_row_stats
        launch_row_stats(x, row)
    else:
        dispatch.accumulate(x, row)


if __name__ == "__main__":
    sys.exit(main())
