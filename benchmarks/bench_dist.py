"""Cost of the distributed flush in a DDP job: the reduction (the default) and the all-gather.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_dist.py [--steps 50] [--out DIR]
    python benchmarks/bench_dist.py --smoke [--out DIR]   # 2 processes, gloo, CPU, tiny sizes

A stack of MLP blocks under DDP (bf16 autocast on CUDA, AdamW), every tensor role read every
step (`every=1`, the worst case for the flush payload). Configurations, measured in one job
and interleaved:
- no monitor;
- per-rank, no exchange (dist.mode="per_rank", dist.divergence=False): no collective at all;
- rank0 via a gloo side group (dist.backend="gloo", the default of CPU jobs: merged by
  reduction), flush every step / every 10;
- the same with dist.merge="gather" (one all-gather of every rank's rows);
- rank0 via the job's own group (dist.backend="default", the default of NCCL jobs: the
  reductions queued on the device and read a step end later).
Reported on rank 0: median ms/step, overhead against the monitor without collectives, mean
time of one flush (pack + collectives + merge) and of its collectives alone, bytes each rank
sends and receives per flush.
Writes bench_dist.csv and bench_dist.md to --out; prints the markdown table last.
"""
from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import stabilitywatch as sw


def configs(smoke: bool) -> dict:
    base = dict(every=1, warmup=0, sinks=("jsonl",), capture=(), roles=tuple(
        r for r in sw.Role if r is not sw.Role.INPUT))
    out = {
        "no monitor": None,
        "per-rank, no collective": sw.Config(**base, dist={"mode": "per_rank",
                                                           "divergence": False}),
        "rank0, gloo side group, flush every step": sw.Config(**base, dist={"backend": "gloo"}),
        "rank0, gloo side group, flush every 10": sw.Config(**base, dist={"flush_every": 10,
                                                                          "backend": "gloo"}),
        "rank0, gloo, all-gather, flush every step": sw.Config(**base, dist={"merge": "gather",
                                                                             "backend": "gloo"}),
        "rank0, job group (nccl), flush every step": sw.Config(**base, dist={"backend": "default"}),
    }
    return out


def build(layers: int, dim: int, device):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks).to(device)


def run_config(name, cfg, a, device, tmp) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    model = build(a.layers, a.dim, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(rank)
    data = [torch.randn(a.batch, a.dim, generator=g).to(device) for _ in range(4)]
    mon = None
    flush_t, gather_t = [], []
    if cfg is not None:
        mon = sw.watch(ddp, opt, config=cfg, run_dir=Path(tmp) / name.replace(" ", "_")
                       .replace(",", "").replace("(", "").replace(")", ""))
        if getattr(mon.dist, "flights", None) is not None:
            # the device path: a step end's host work is its whole frames() call (the rounds
            # of several flushes in flight), the collectives' part is starting them
            _time(mon.dist, "frames", flush_t)
            _time(mon.dist.flights.ops, "start", gather_t)
        elif mon.dist.active:
            _time(mon.dist, "_flush", flush_t)
            _time(mon.dist, "_reduce", flush_t)
            _time(mon.dist, "_gather", gather_t)
            _time(mon.dist.comm, "all_reduce", gather_t)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _null()
    times, start, start_c, start_b = [], 0, 0, 0
    for step in range(a.warmup + a.steps):
        x = data[step % len(data)]
        if step == a.warmup:   # flushes of the timed steps only (not warm-up, not close)
            start, start_c = len(flush_t), len(gather_t)
            start_b = mon.dist.bytes_sent if mon is not None and mon.dist.active else 0
        t0 = time.perf_counter()
        ctx = mon.step(step, batch=x) if mon is not None else _null()
        with ctx:
            with amp:
                loss = ddp(x).float().square().mean()
            loss.backward()
            if mon is not None:
                mon.observe_loss(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    nbytes = received = 0
    if mon is not None:
        end, end_c = len(flush_t), len(gather_t)
        if mon.dist.active and end > start:
            nbytes = (mon.dist.bytes_sent - start_b) / (end - start)
            # an all-reduce returns what it was given; an all-gather returns world x it
            received = nbytes * (dist.get_world_size() if cfg.dist.merge.value == "gather"
                                 else 1)
        mon.close()
        flush_t, gather_t = flush_t[start:end], gather_t[start_c:end_c]
    del ddp, model, opt
    return {"config": name, "ms_step": statistics.median(times),
            "flush_ms": statistics.mean(flush_t) * 1e3 if flush_t else 0.0,
            "collective_ms": sum(gather_t) / len(flush_t) * 1e3 if flush_t else 0.0,
            "flushes": len(flush_t), "bytes_per_rank": nbytes, "received_per_rank": received}


def _time(obj, attr, sink):
    fn = getattr(obj, attr)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            sink.append(time.perf_counter() - t0)
    setattr(obj, attr, timed)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False


def worker(a) -> list:
    cuda = torch.cuda.is_available() and not a.smoke
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    cfgs = configs(a.smoke)
    if backend != "nccl":
        cfgs = {k: v for k, v in cfgs.items() if "nccl" not in k}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):       # interleaved, so drift hits every configuration alike
            for name, cfg in cfgs.items():
                rows.append(run_config(name, cfg, a, device, tmp))
                dist.barrier()
    dist.destroy_process_group()
    return rows, device, backend


def summarise(rows, a, device, backend) -> str:
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    med = {k: {f: statistics.median(x[f] for x in v) for f in
               ("ms_step", "flush_ms", "collective_ms", "bytes_per_rank",
                "received_per_rank")}
           for k, v in by.items()}
    ref = med.get("per-rank, no collective", {}).get("ms_step")
    what = (f"{dist_world(a)} ranks, {backend} job, {device.type}; {a.layers} MLP blocks of "
            f"d={a.dim}, batch {a.batch}; median of {a.steps} steps x {a.repeats}")
    lines = [f"Flush overhead ({what})", "",
             "| configuration | ms/step | vs per-rank | flush ms | collectives ms | "
             "sent B/rank | received B/rank |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, m in med.items():
        rel = f"{(m['ms_step'] / ref - 1) * 100:+.1f}%" if ref and k != "no monitor" else "-"
        lines.append(f"| {k} | {m['ms_step']:.2f} | {rel} | {m['flush_ms']:.3f} | "
                     f"{m['collective_ms']:.3f} | {int(m['bytes_per_rank'])} | "
                     f"{int(m['received_per_rank'])} |")
    return "\n".join(lines)


def dist_world(a) -> int:
    return 2 if a.smoke else int(os.environ.get("WORLD_SIZE", 1))


def _spawned(rank, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    a = parse(argv)
    rows, device, backend = worker(a)
    if rank == 0:
        finish(rows, a, device, backend)


def finish(rows, a, device, backend) -> None:
    text = summarise(rows, a, device, backend)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "bench_dist.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        (out / "bench_dist.md").write_text(text + "\n")
    print(text, flush=True)


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="2 processes on gloo/CPU, tiny sizes (for the test suite)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.repeats, a.layers, a.dim, a.batch = 3, 1, 1, 2, 16, 4
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.smoke:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(port, argv), nprocs=2, join=True)
        return 0
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --standalone --nproc_per_node=2 "
              "benchmarks/bench_dist.py (or --smoke)", file=sys.stderr)
        return 2
    rows, device, backend = worker(a)
    if int(os.environ["RANK"]) == 0:
        finish(rows, a, device, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
