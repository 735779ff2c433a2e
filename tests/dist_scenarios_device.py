"""Scenarios of the flush on the job's own group, queued and read a step end later
(distributed/deferred.py): run on every rank by tests/distutil.run_ranks
(test_distributed_device.py on gloo CPU tensors, test_distributed_device_gpu.py on NCCL)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import stabilitywatch as sw
from dist_scenarios import QUIET, _batches, _common, _flip_lowest_bit, _mlp


def _spy_reads(mon, state: dict) -> list:
    """(step end it started at, step end it was read at, read while closing) per collective."""
    log = []
    ops = mon.dist.flights.ops
    start = ops.start

    def spied(kind, a):
        op = start(kind, a)
        began, result = mon.dist._ends, op.result

        def read():
            log.append((began, mon.dist._ends, state["closing"]))
            return result()
        op.result = read
        return op
    ops.start = spied
    return log


def device_reads_later(rank, world, run_dir, device="cpu", steps=7, flip_step=4,
                       sync_debug=False, ddp=True):
    """DDP (or, ddp=False, the bare model) with the flush on the job's group
    (dist.backend="default"), a flipped bit on the last rank at `flip_step`: which step end
    reads each collective, the alerts, the records. With sync_debug (CUDA) the steps after the
    first two run under set_sync_debug_mode("error"): a host sync anywhere in them raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device("cpu")
    model = _mlp().to(dev)
    ddp = DDP(model, device_ids=[dev.index] if device == "cuda" else None) if ddp else model
    # fused on CUDA: the step's count stays on the device (no host sync in step())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=device == "cuda")
    cfg = sw.Config(**QUIET, capture=(), dist={"backend": "default"})
    mon = sw.watch(ddp, opt, config=cfg, run_dir=run_dir)
    if world == 1:   # one process: the coordinator a job of several ranks gets, on its group
        from stabilitywatch.distributed import DistCoordinator
        from stabilitywatch.distributed.runinfo import RunInfo
        mon.dist = DistCoordinator(RunInfo(rank=rank, world_size=1, config=cfg,
                                           has_optimizer=True, release=mon._release_frame))
    state = {"closing": False}
    log = _spy_reads(mon, state)
    in_flight = []
    xs = [x.to(dev) for x in _batches(rank, steps)]   # a copy from pageable memory syncs
    try:
        for step, x in enumerate(xs):
            if sync_debug and step == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            if step == flip_step and rank == world - 1 and world > 1:
                _flip_lowest_bit(model[0].weight)   # on the device, no sync
            with mon.step(step, batch=x):
                loss = ddp(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
            in_flight.append(len(mon.dist.flights))
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode(0)
    state["closing"] = True
    mon.close()
    recs = [json.loads(line) for line in (Path(run_dir) / "stats.jsonl").read_text().splitlines()] \
        if rank == 0 else []
    return {**_common(mon), "reads": log, "in_flight": in_flight,
            "records": {f"{r['step']}:{r['module']}:{r['tensor']}": r["stats"] for r in recs},
            "device": str(mon.dist.device)}


def side_group_twin(rank, world, run_dir, steps=7, flip_step=4):
    """device_reads_later's run on the gloo side group: the records and alerts to compare."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _mlp()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    cfg = sw.Config(**QUIET, capture=(), dist={"backend": "gloo"})
    mon = sw.watch(ddp, opt, config=cfg, run_dir=run_dir)
    for step, x in enumerate(_batches(rank, steps)):
        if step == flip_step and rank == world - 1:
            _flip_lowest_bit(model[0].weight)
        with mon.step(step, batch=x):
            loss = ddp(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    mon.close()
    recs = [json.loads(line) for line in (Path(run_dir) / "stats.jsonl").read_text().splitlines()] \
        if rank == 0 else []
    return {**_common(mon),
            "records": {f"{r['step']}:{r['module']}:{r['tensor']}": r["stats"] for r in recs}}


def guard_flags(rank, world, run_dir, dist_mode="per_rank", dist_backend="auto"):
    """The guard on, a NaN in rank 1's gradient of one bias at step 3 (unsampled; replicas
    without DDP, so each rank's gradients are its own): the step's one cross-rank reduction
    carries the flag and, per gradient, the ranks whose gradient was bad. In per_rank mode rank
    0 writes its own frames: its alert names the gradient and the rank from that reduction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    cfg = sw.Config(every=10, warmup=0, guard={"on_nonfinite": "skip"}, sinks=("jsonl",),
                    capture=(), dist={"mode": dist_mode, "backend": dist_backend})
    mon = sw.watch(model, opt, config=cfg, run_dir=run_dir)
    sizes = []
    for step in range(6):
        x = torch.randn(16, 8, generator=g)
        if step == 3:
            before = [p.detach().clone() for p in model.parameters()]
        with mon.step(step, batch=x):
            loss = model(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            if step == 3 and rank == 1:
                model[2].bias.grad[0] = float("nan")
            opt.step()
            opt.zero_grad()
            sizes.append(int(mon.buffer.sentinel._flag.numel()))
        if step == 3:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    sent = {s: mon.buffer.sentinel_of(s) for s in range(6)}
    mon.close()
    rows = {s: {f"{m}:{r}": [int(v) for v in sf.row_ranks[i]] for i, (m, r) in enumerate(sf.keys)}
            for s, sf in sent.items() if sf is not None and sf.row_ranks is not None}
    return {**_common(mon), "unchanged_at_3": unchanged, "flag_sizes": sizes,
            "grads": len(mon.buffer.sentinel.keys), "row_ranks": rows,
            "bad_rank_lo": sent[3].bad_rank_lo if sent.get(3) else None}
