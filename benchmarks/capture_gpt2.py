"""bench_capture.py --model gpt2: the step-time runs and the ring-memory line on
bench_overhead.py's GPT-2-small-shaped model (its model, batch and loss, not a copy)."""
from __future__ import annotations

import gc
import time

import torch

import bench_overhead as bo
from stabilitywatch import Config, watch


def shapes(smoke: bool, device: str) -> dict:
    # as bench_overhead.py: the full-size model is a GPU benchmark
    return bo.shapes(smoke or device == "cpu")


def setup(s: dict):
    """For bench_capture.snapshot_cost: device -> (model, optimizer, batch, loss function)."""
    return lambda device: (*bo.build(s, device), bo.loss_fn)


def run(s: dict, device: str, steps: int, cfg: Config, out: str) -> tuple[float, int | None]:
    """ms/step and peak bytes of monitored training, timed after bench_overhead's warm-up steps
    (monitor kernels compile, the ring is allocated). The mean, not a median of steps: at the
    default cadence only 1 step in 10 takes a snapshot."""
    gc.collect()   # the previous run's monitor and model hold reference cycles: free them first
    model, opt, batch = bo.build(s, device)
    mon = watch(model, opt, config=cfg, run_dir=out)
    cuda = device == "cuda"
    try:
        for step in range(s["warm"] + steps):
            if step == s["warm"]:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
            with mon.step(step, batch=batch):
                loss = bo.loss_fn(model, batch)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        mon.close()
    return ms, torch.cuda.max_memory_allocated() if cuda else None


def ring_line(snap: dict, device: str, where: str) -> str:
    # On CUDA frames are read one step late, so two sampled steps in a row (every step, or the
    # config's warm-up at any cadence) fill the whole ring, and slot buffers stay allocated. The
    # CPU reads them at the end of the step: one slot (as in snapshot_cost, which releases each
    # snapshot before the next).
    used = snap["slots"] if device == "cuda" else 1
    ring, own, peak = used * snap["slot_bytes"], snap["param_bytes"] + snap["optim_bytes"], \
        snap["step_peak_bytes"]
    return (f"ring held in training: {used} slot(s), {ring / 2**20:.2f} MiB in {where} "
            f"memory = {ring / own:.2f}x parameters + optimizer state"
            + (f" = {ring / peak:.1%} of a training step's peak ({peak / 2**20:.0f} MiB)"
               if peak else "; peak memory: CUDA only"))
