"""CPU time of the W&B and TensorBoard sinks' log() on the sink's thread, per frame of a
GPT-2-small-shaped row set (76 modules x 8 roles = 608 rows; default Config's dashboards).

    WANDB_MODE=offline python benchmarks/bench_sink_cpu.py

Thread CPU time (time.thread_time), so a loaded machine changes it less than wall time: it is
the Python work that holds the GIL the training thread needs. The W&B sink logs into a run of
its own (offline); the TensorBoard sink hands the frame to its writer process.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from stabilitywatch.kernels.dispatch import compute_row  # noqa: E402
from stabilitywatch.sinks import TensorBoardSink, WandbSink  # noqa: E402
from stabilitywatch.stats.derive import derive_many  # noqa: E402

ROLES = ["output", "grad_output", "weight", "bias", "grad", "grad.bias", "optim.exp_avg",
         "optim.exp_avg_sq"]


def main() -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    torch.manual_seed(0)
    rows = np.stack([compute_row(torch.randn(1000), 1.0).numpy() for _ in range(608)])

    def frame(step):
        st = derive_many(rows, [1.0] * len(rows))
        return [{"schema": 1, "rank": 0, "world_size": 1, "module": f"m{i // 8}",
                 "tensor": ROLES[i % 8], "step": step, "stats": st[i]} for i in range(len(rows))]

    print("| sink | sink-thread CPU ms per 608-row frame (median of 7) |")
    print("|---|---:|")
    for name in ("tensorboard", "wandb"):
        with tempfile.TemporaryDirectory() as d:
            sink = TensorBoardSink(d) if name == "tensorboard" else WandbSink(d, run="own")
            sink.log(frame(0))
            times = []
            for step in range(1, 8):
                f = frame(step)
                t = time.thread_time()
                sink.log(f)
                times.append(time.thread_time() - t)
            sink.close()
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
