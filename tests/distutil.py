"""Running test scenarios on several processes (torch.distributed, gloo on 127.0.0.1).

`run_ranks` starts `world` processes with torch.multiprocessing, each joins a process
group on a free port and runs the named scenarios of tests/dist_scenarios.py (or
dist_scenarios_gpt2.py) in order, writing
`<out>/<scenario>/result.rank{r}.json`. Nothing here can block CI: the whole run has a deadline,
the process group and every collective have timeouts, and processes still alive at the deadline
are killed (by their handle) and reported as hung.

`start_ranks` starts the processes from a forkserver that has imported torch, the package and
the scenario modules once: every rank is a fresh process (nothing of the test process's state,
no process group, no threads), without paying an interpreter's start and torch's import each.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the forkserver; every rank forked from it starts with them loaded
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "stabilitywatch",
           "stabilitywatch.kernels.dispatch", "numpy", "distutil", "dist_scenarios",
           "dist_scenarios_gpt2", "dist_guard"]


def start_ranks(fn, args: tuple, world: int):
    """torch.multiprocessing.start_processes(fn, args, world) from the preloaded forkserver.
    The forkserver keeps the environment and working directory it started with: ranks set
    what they need themselves (MASTER_ADDR/PORT in their entry)."""
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=world, join=False,
                              start_method="forkserver")


def _entry(rank, world, port, out, scenarios, backend, pg_timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    import dist_scenarios
    import dist_scenarios_device
    import dist_scenarios_gpt2
    try:
        for item in scenarios:
            label, name, kwargs = item if len(item) == 3 else (item[0], *item)
            d = Path(out) / label
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            try:
                fn = getattr(dist_scenarios, name, None) or getattr(dist_scenarios_device, name,
                                                                    None) \
                    or getattr(dist_scenarios_gpt2, name)
                res = fn(rank, world, d, **kwargs) or {}
                res["ok"] = True
            except BaseException:
                res = {"ok": False, "error": traceback.format_exc()}
            res["seconds"] = time.monotonic() - t0
            (d / f"result.rank{rank}.json").write_text(json.dumps(res, default=str))
            if not res["ok"]:
                break   # the other ranks may be out of step now: do not start another scenario
            if not res.get("no_barrier"):
                dist.barrier()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(out: Path, scenarios: list, world: int = 2, timeout: float = 60.0,
              backend: str = "gloo", pg_timeout: float = 30.0) -> dict:
    """Run scenarios [(name, kwargs) or (label, name, kwargs), ...] on `world` processes
    (results and run directories under out/<label>). Returns {"hung": [...ranks],
    "exitcodes": [...], "seconds": wall time}."""
    t0 = time.monotonic()
    ctx = start_ranks(_entry, (world, free_port(), str(out), scenarios, backend, pg_timeout),
                      world)
    procs = ctx.processes
    deadline = t0 + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    return {"hung": hung, "exitcodes": [p.exitcode for p in procs],
            "seconds": time.monotonic() - t0}


def results(out: Path, name: str, world: int = 2) -> list:
    """Per-rank result dicts of one scenario (None for a rank that wrote none)."""
    res = []
    for r in range(world):
        f = Path(out) / name / f"result.rank{r}.json"
        res.append(json.loads(f.read_text()) if f.exists() else None)
    return res


def read_jsonl(path: Path) -> list:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
