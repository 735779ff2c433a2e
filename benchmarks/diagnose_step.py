"""Where a sampled step's extra time goes, default config, GPT-2-small-shaped model (GPU):

    python benchmarks/diagnose_step.py [--config default|full]

Prints wall time of unsampled and sampled steps (synced), the host time of each step (from its
start until the call returns, the GPU idle at the start), the GPU time of the statistics kernels
in a sampled step (torch.profiler), and the host functions that take the most time over a
sampled step and the next one (cProfile; frames are read one step late).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

import stabilitywatch as sw

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_overhead import build, full_coverage, shapes, train_step  # noqa: E402


def main() -> None:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=("default", "full"), default="default")
    a = p.parse_args()
    import logging
    logging.basicConfig(format="%(relativeCreated)d ms %(message)s")
    logging.getLogger("stabilitywatch").setLevel(logging.DEBUG)  # first launches (compiles)
    s = shapes(False)
    model, opt, batch = build(s, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = sw.Config(sinks=("jsonl",)) if a.config == "default" else full_coverage()
        mon = sw.watch(model, opt, config=cfg, run_dir=tmp)

        def step(i):
            train_step(model, opt, batch, mon, i)

        for i in range(12):
            step(i)
        torch.cuda.synchronize()
        walls = {}
        for i in range(12, 32):
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            walls[i] = (time.perf_counter() - t0) * 1e3
            logging.getLogger("stabilitywatch").debug("step %d done", i)
        print("wall ms per step:", {k: round(v, 1) for k, v in walls.items()})
        hosts = {}
        for i in range(32, 42):  # the host's own time: the call returns before the GPU is done
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            hosts[i] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        print("host ms per step:", {k: round(v, 1) for k, v in hosts.items()})
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            step(50)
            torch.cuda.synchronize()
        tot, ours, n = 0.0, 0.0, 0
        for e in p.key_averages():
            t = e.self_device_time_total
            tot += t
            if "stats" in e.key or "accumulate" in e.key:
                ours += t
                n += e.count
        print(f"sampled step GPU: total {tot / 1e3:.1f} ms, statistics kernels {ours / 1e3:.1f} ms "
              f"in {n} launches")
        durs = sorted((e.device_time_total for e in p.events()
                       if "stats" in e.name or "accumulate" in e.name), reverse=True)
        print("statistics kernels, longest first (us):", [round(d) for d in durs[:24]],
              f"... {len(durs)} in all, the rest {sum(durs[24:]) / 1e3:.1f} ms")
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=8,
                                     max_name_column_width=60))
        pr = cProfile.Profile()
        pr.enable()
        step(60)
        step(61)
        torch.cuda.synchronize()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[-6000:])
        mon.close()


if __name__ == "__main__":
    main()
