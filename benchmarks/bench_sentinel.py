"""The every-step gradient sentinel alone, on GPT-2 small's parameter gradients (float32, 124 M
elements, 475 MiB), against the read-once floor and torch's foreach ops, in one run (GPU; a CPU
smoke size runs the same code, the kernel under the interpreter):

    python benchmarks/bench_sentinel.py [--shapes "2048x32;4096x16;1024x64"] [--smoke]

Rows: the kernel launch alone (kernels/sentinel.py, with the zeroing of its output) for several
(BLOCK x ITERS) chunk shapes; the whole per-step path the taps take (SentinelStore.write: the
plan check, the zeroing, the launch), with its host time; the pure-torch twin; and torch's
`_amp_foreach_non_finite_check_and_unscale_`, `_foreach_norm(inf)` and `_foreach_norm(2)`
(the latter two together give absmax and the norm, but count no NaN/Inf and let them through).
GPU times are do_bench medians (L2 flushed between calls).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stabilitywatch.kernels.sentinel import BLOCK, ITERS, SentinelLaunch  # noqa: E402
from stabilitywatch.stats.sentinel import COLS, sentinel_reference  # noqa: E402
from stabilitywatch.kernels.backend import kernel_backend  # noqa: E402
from stabilitywatch.stats.sentinel_store import SentinelStore  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_stats import read_bandwidth, timer  # noqa: E402


def grad_shapes(smoke: bool) -> list:
    """GPT-2 small's parameters (the tied lm_head shares wte): embeddings, then per layer
    ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj (weights and biases), then ln_f."""
    d, v, layers, seq = (64, 512, 2, 64) if smoke else (768, 50304, 12, 1024)
    per_layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
                 (4 * d,), (4 * d, d), (d,)]
    return [(v, d), (seq, d)] + per_layer * layers + [(d,), (d,)]


def host_us(fn, n: int = 20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e6 / n


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=f"{BLOCK}x{ITERS};4096x16;1024x64;2048x16",
                   help="kernel chunk shapes BLOCKxITERS, ;-separated")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = timer(device)
    bw = read_bandwidth(device, t)
    torch.manual_seed(0)
    grads = [torch.randn(s, device=device) for s in grad_shapes(a.smoke)]
    flats = [g.view(-1) for g in grads]
    n = len(grads)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    floor = nbytes / bw
    out = torch.zeros(n, COLS, dtype=torch.float64, device=device)
    slots = list(range(n))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"# bench_sentinel on {name}: {n} gradients, {nbytes / 2**20:.1f} MiB float32; read "
          f"bandwidth {bw / 1e6:.3f} TB/s; read-once floor {floor:.1f} us")
    rows = []

    def row(what, us, host=float("nan"), note=""):
        rows.append(f"| {what} | {us:.1f} | {us / floor:.2f} | {host:.1f} | {note} |")

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(";") if s]
    if a.smoke:
        shapes = shapes[:1]
    for blk, its in shapes:
        launch = SentinelLaunch(flats, slots, out.device, block=None if a.smoke else blk,
                                iters=None if a.smoke else its)

        def k(launch=launch):
            out.zero_()
            launch.run(out)
        row(f"sentinel kernel {blk}x{its}" if not a.smoke else "sentinel kernel (interpreter)",
            t(k), note=f"{launch.grid} programs")
    store = SentinelStore(kernel_backend("auto" if device == "cuda" else "triton"))
    store.set_keys([("m", str(i)) for i in range(n)])
    items = list(enumerate(grads))
    store.write(items)
    row("SentinelStore.write (each gradient checked, plan kept)", t(lambda: store.write(items)),
        host_us(lambda: store.write(items)) if device == "cuda" else float("nan"),
        "plan kept, same addresses")
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for q, g in zip(params, grads):
        q.grad = g
    store.write(items)
    assert store.write_again(params)
    row("SentinelStore.write_again (the taps' path)", t(lambda: store.write_again(params)),
        host_us(lambda: store.write_again(params)) if device == "cuda" else float("nan"),
        "gradients where they were")
    ref_out = torch.zeros_like(out)
    row("pure-torch twin", t(lambda: sentinel_reference(grads, ref_out, slots)))
    found = torch.zeros((), device=device)
    inv = torch.ones((), device=device)
    if device == "cuda":
        row("torch _amp_foreach_non_finite_check_and_unscale_",
            t(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)),
            note="a found-inf flag only")
    row("torch _foreach_norm(inf)", t(lambda: torch._foreach_norm(grads, float("inf"))),
        note="absmax, NaN/Inf not separated")
    row("torch _foreach_norm(2)", t(lambda: torch._foreach_norm(grads, 2)))
    print("| what | us | / floor | host us | note |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
