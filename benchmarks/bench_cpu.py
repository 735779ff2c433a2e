"""What the monitor costs on the CPU, in one run: tensor_stats per dtype, a small HF GPT-2 with the
default config and preset("full") against no monitor, and the demo (its model, loop and
`demo_config()`) against no monitor.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu.py [--steps 30] [--repeats 3] [--threads 1]

Same-run ratios: the configurations of one model alternate (repeats x configurations); GPT-2 runs
are measured over steps 15 to 15 + steps (past the default config's warm-up, which samples every
step), the demo over all its steps; the tables give the median over repeats.
tensor_stats: 65,536 values, the median of many calls, next to the pure-torch reference
(stats/reference.py) it is tested against. The gradient sentinel: every parameter gradient of the
small GPT-2 after one backward, numpy (stats/sentinel_cpu.py, the monitor's path on the CPU)
against the pure-torch twin (stats/sentinel.py), the median of many calls. Prints markdown tables.
The CPU statistics are the compiled loops (stats/cpu_jit.py, waited for before any timing) where
numba is installed; --numpy times the numpy passes instead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import stabilitywatch as sw
from stabilitywatch.demo import run_demo
from stabilitywatch.stats import cpu_jit
from stabilitywatch.stats.reference import reference_row
from stabilitywatch.stats.sentinel import COLS, sentinel_reference
from stabilitywatch.stats.sentinel_cpu import sentinel_host

DTYPES = [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
          ("float64", torch.float64), ("float8_e4m3fn", torch.float8_e4m3fn),
          ("float8_e5m2", torch.float8_e5m2)]


def _median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_tensor_stats(calls: int) -> list[tuple[str, float, float]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for name, dtype in DTYPES:
        x = (torch.randn(65536, generator=g) * 3).to(dtype)
        fast = _median_ms(lambda: sw.tensor_stats(x), calls)
        ref = _median_ms(lambda: reference_row(x), max(calls // 10, 3))
        out.append((name, fast, ref))
    return out


def gpt2(batch: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=seq,
                     bos_token_id=0, eos_token_id=0,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return model, opt, {"input": ids[:, :-1], "target": ids[:, 1:]}


def bench_sentinel(calls: int, batch: int, seq: int) -> tuple[int, int, float, float]:
    model, _, data = gpt2(batch, seq)
    logits = model(data["input"]).logits
    F.cross_entropy(logits.view(-1, logits.shape[-1]), data["target"].reshape(-1)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    slots = list(range(len(grads)))
    out = torch.zeros(len(grads), COLS, dtype=torch.float64)
    fast = _median_ms(lambda: sentinel_host(grads, out.zero_(), slots), calls)
    ref = _median_ms(lambda: sentinel_reference(grads, out.zero_(), slots), max(calls // 4, 3))
    return len(grads), sum(g.numel() for g in grads), fast, ref


def gpt2_run(config, steps: int, out: str, batch: int, seq: int, warmup: int) -> float:
    """(ms per step, the training thread's CPU ms per step) over the steps after `warmup` (the
    default config samples every step of its warm-up, then every 10th)."""
    model, opt, data = gpt2(batch, seq)
    mon = sw.watch(model, opt, config=config, run_dir=out) if config is not None else None
    times, cpu = [], []
    try:
        for step in range(warmup + steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            ctx = mon.step(step, batch=data) if mon else _Null()
            with ctx:
                logits = model(data["input"]).logits
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), data["target"].reshape(-1))
                loss.backward()
                if mon:
                    mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    finally:
        if mon:
            t0, c0 = time.perf_counter(), time.thread_time()
            mon.close()
            times[-1] += time.perf_counter() - t0   # the flush at close counts
            cpu[-1] += time.thread_time() - c0
    return statistics.mean(times[warmup:]) * 1e3, statistics.mean(cpu[warmup:]) * 1e3


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def interleaved(runs: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """name -> medians over repeats of (wall ms, CPU ms) per step; fn() gives one run's pair."""
    times: dict[str, list] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(fn())
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in times.items()}


def _table(title: str, res: dict) -> None:
    print(f"\n| {title} | ms/step | ratio | training thread CPU ms/step | ratio |")
    print("|---|---:|---:|---:|---:|")
    w0, c0 = res["no monitor"]
    for name, (w, c) in res.items():
        print(f"| {name} | {w:.1f} | {w / w0:.2f}x | {c:.1f} | {c / c0:.2f}x |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=200, help="tensor_stats calls per dtype")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    p.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    p.add_argument("--numpy", action="store_true",
                   help="the numpy passes throughout, not the compiled loops")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.repeats, a.calls, a.batch, a.seq = 2, 1, 1, 3, 2, 16
    if a.threads:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# CPU, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch thread(s), load average {load:.1f} at start")
    if a.numpy:
        cpu_jit.ENABLED = False
    t0 = time.perf_counter()
    compiled = cpu_jit.wait()   # compiled once per machine (numba caches it), before any timing
    print(f"# CPU statistics: {'compiled loops, ready in %.1f s' % (time.perf_counter() - t0) if compiled else 'numpy passes'}")

    print("\n| tensor_stats, 65,536 values | CPU path (ms) | reference (ms) |")
    print("|---|---:|---:|")
    for name, fast, ref in bench_tensor_stats(a.calls):
        print(f"| {name} | {fast:.3f} | {ref:.2f} |")

    k, numel, fast, ref = bench_sentinel(max(a.calls // 10, 3), a.batch, a.seq)
    print(f"\n| gradient sentinel, HF GPT-2 (4 layers, d 128): {k} gradients, {numel:,} float32 "
          f"values | numpy (ms) | pure-torch twin (ms) |")
    print("|---|---:|---:|")
    print(f"| one step's sentinel | {fast:.2f} | {ref:.2f} |")

    with tempfile.TemporaryDirectory() as tmp:
        n = iter(range(10**6))
        g = interleaved({
            "no monitor": lambda: gpt2_run(None, a.steps, f"{tmp}/{next(n)}", a.batch, a.seq,
                                           a.warmup),
            "default Config()": lambda: gpt2_run(sw.Config(sinks=("jsonl",)), a.steps,
                                                 f"{tmp}/{next(n)}", a.batch, a.seq, a.warmup),
            'preset("full")': lambda: gpt2_run(sw.Config.preset("full", sinks=("jsonl",)),
                                               a.steps, f"{tmp}/{next(n)}", a.batch, a.seq,
                                               a.warmup),
        }, a.repeats)
        _table(f"HF GPT-2 (4 layers, d 128), batch {a.batch} x {a.seq}, steps {a.warmup}-"
               f"{a.warmup + a.steps - 1} x {a.repeats}", g)

        def demo(monitor: bool) -> tuple[float, float]:
            r = run_demo(f"{tmp}/{next(n)}", device="cpu", steps=a.steps + 2, fault_step=10**9,
                         monitor=monitor)
            return r.ms_per_step, r.cpu_ms_per_step

        d = interleaved({"no monitor": lambda: demo(False), "demo config": lambda: demo(True)},
                        a.repeats)
        _table(f"demo model, {a.steps + 2} steps x {a.repeats}", d)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n# load average {load:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
