"""The multi-tensor tile launch (kernels/tile_multi.py) over GPT-2 small's weight shapes, for
several numbers of tiles per program, against the read-once floor measured in the same run
(GPU; a CPU smoke size runs the same code under the interpreter, where programs are fixed):

    python benchmarks/bench_multi.py [--per-prog "8;16;32;64"] [--smoke]

This is the launch that reads a tap's weights, gradients or optimizer states (every parameter of
more than MULTI_MAX elements, full tiles only). Each program zeroes and reads back its 32 KiB
lane histogram, a fixed cost that its tiles share.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stabilitywatch.kernels.tile_multi import TILES_PER_PROG, TileManyLaunch  # noqa: E402
from stabilitywatch.stats.layout import init_row_tensor  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_stats import read_bandwidth, timer  # noqa: E402


def weight_shapes(smoke: bool) -> list:
    """GPT-2 small's matrices: token and position embeddings, then per layer qkv, attention
    out, fc1, fc2 (the smoke size: one layer of width 64, a vocabulary of 256; under the
    interpreter each 8192-element tile costs ~0.15 s, and these 7 tiles still mix tensors of
    1 and 2 tiles with tensors of none)."""
    d, v, layers, seq = (64, 256, 1, 64) if smoke else (768, 50304, 12, 1024)
    per_layer = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    return [(v, d), (seq, d)] + per_layer * layers


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-prog", default="8;16;32;64", help="tiles per program, ;-separated")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = timer(device)
    bw = read_bandwidth(device, t)
    shapes = weight_shapes(a.smoke)
    per_progs = [int(s) for s in a.per_prog.split(";") if s]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"# bench_multi on {name}: {len(shapes)} tensors; read bandwidth {bw / 1e6:.3f} "
          f"TB/s; default {TILES_PER_PROG} tiles per program")
    print("| dtype | MiB | floor us | tiles per program | programs | us | us / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        flats = [torch.randn(s, device=device).to(dtype).view(-1) for s in shapes]
        nbytes = sum(f.numel() * f.element_size() for f in flats)
        rows = init_row_tensor(device, len(flats))
        floor = nbytes / bw
        for per in per_progs:
            launch = TileManyLaunch(flats, list(range(len(flats))), rows.device, per_prog=per)
            us = t(lambda: launch.run(rows))
            print(f"| {str(dtype).split('.')[-1]} | {nbytes / 2**20:.1f} | {floor:.1f} | {per} | "
                  f"{launch.grid} | {us:.1f} | {us / floor:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
