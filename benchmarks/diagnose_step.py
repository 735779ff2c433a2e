"""Where a sampled step's extra time goes, default config, GPT-2-small-shaped model (GPU):

    python benchmarks/diagnose_step.py

Prints wall time of unsampled and sampled steps (synced), the GPU time of the statistics kernels
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
from bench_overhead import build, loss_fn, shapes  # noqa: E402


def main() -> None:
    import logging
    logging.basicConfig(format="%(relativeCreated)d ms %(message)s")
    logging.getLogger("stabilitywatch").setLevel(logging.DEBUG)  # first launches (compiles)
    s = shapes(False)
    model, opt, batch = build(s, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",)), run_dir=tmp)

        def step(i):
            with mon.step(i, batch=batch):
                loss = loss_fn(model, batch)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)

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
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            step(40)
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
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=8,
                                     max_name_column_width=60))
        pr = cProfile.Profile()
        pr.enable()
        step(50)
        step(51)
        torch.cuda.synchronize()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[-6000:])
        mon.close()


if __name__ == "__main__":
    main()
