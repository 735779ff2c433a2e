"""Scenarios run on every rank by tests/distutil.run_ranks (see tests/test_distributed.py).

Each takes (rank, world, run_dir, **kwargs) and returns a JSON-able dict of what the test
checks; a rank's failure is recorded and stops the later scenarios.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.distributed.merge import KIND_NAMES
from stabilitywatch.kernels.dispatch import compute_row
from stabilitywatch.stats.layout import N_STATS, Stat

QUIET = dict(sinks=("jsonl",), every=1, warmup=0)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _batches(rank: int, n: int, shape=(8, 16)):
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _keep_frames(mon) -> list:
    """The frames the monitor processes (on rank 0 in rank0 mode: the merged ones)."""
    frames, handle = [], mon._handle

    def spy(frame):
        frames.append(frame)
        return handle(frame)
    mon._handle = spy
    return frames


def _flip_lowest_bit(p: torch.Tensor, index: int = 5) -> None:
    with torch.no_grad():
        bits = p.data.view(torch.int32).view(-1)
        bits[index] ^= 1


def _common(mon) -> dict:
    return {"alerts": [a.to_dict() for a in mon.alerts], "flushes": mon.dist.flushes,
            "collectives": mon.dist.collectives, "detached": mon.dist.detached,
            "frames_seen": mon.frames_seen, "path": getattr(mon.dist, "path", None)}


# -- DDP: a flipped bit on one rank -------------------------------------------------------------
def ddp_bitflip(rank, world, run_dir, device="cpu", dist_backend="auto", dist_mode="rank0",
                flip_step=4, steps=8, dist_merge="reduce"):
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    model = _mlp().to(dev)
    ddp = DDP(model, device_ids=[rank] if device == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    mon = sw.watch(ddp, opt, config=sw.Config(**QUIET, dist={"backend": dist_backend,
                                                              "mode": dist_mode,
                                                              "merge": dist_merge}),
                   run_dir=run_dir)
    frames = _keep_frames(mon)
    losses, out_numel = [], 0
    for step, x in enumerate(_batches(rank, steps)):
        x = x.to(dev)
        if step == flip_step and rank == 1:
            _flip_lowest_bit(model[0].weight)
        with mon.step(step, batch=x):
            out = ddp(x)
            loss = out.square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        out_numel = out.numel()
        losses.append(loss.item())
    mon.close()
    kinds = {}
    for f in frames:
        for (m, r), k in zip(f.keys, getattr(f, "kinds", [])):
            kinds[f"{m}:{r}"] = KIND_NAMES[k]
    return {**_common(mon), "losses": losses, "out_numel": out_numel, "kinds": kinds}


# -- NaN on one rank, keys that only one rank has, flushes every 3 steps -------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, use_extra: bool):
        h = torch.relu(self.a(x))
        if use_extra:          # data-dependent control flow: only rank 1 runs it
            h = h + self.extra(h)
        return self.b(h)


def nan_one_rank(rank, world, run_dir, nan_step=4, steps=9, dist_backend="auto"):
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = sw.Config(**QUIET, dist={"flush_every": 3, "divergence": False,
                                   "backend": dist_backend}, capture=())
    mon = sw.watch(model, opt, config=cfg, run_dir=run_dir)
    losses = []
    for step, x in enumerate(_batches(rank, steps)):
        if rank == 1 and step == nan_step:
            x[0, 0] = float("nan")
        with mon.step(step, batch=x):
            loss = model(x, use_extra=(rank == 1 and step >= 2)).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    mon.close()
    return {**_common(mon), "losses": losses}


# -- statistics of shards against the full tensor ------------------------------------------------
_SUMS = (Stat.SUM, Stat.SUMSQ, Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ)
_EXACT = [i for i in range(N_STATS) if i not in _SUMS]


def _row_mismatch(got: np.ndarray, full: torch.Tensor, rtol: float = 1e-12) -> list:
    want = compute_row(full.detach()).cpu().numpy()
    bad = [Stat(i).name if i < Stat.HIST else f"HIST[{i - Stat.HIST}]"
           for i in _EXACT if not (got[i] == want[i] or (np.isnan(got[i]) and np.isnan(want[i])))]
    for i in (Stat.SUM, Stat.SUMSQ):
        if not np.isclose(got[i], want[i], rtol=rtol, atol=rtol):
            bad.append(Stat(i).name)
    # the shifted sums: SUM - n K in the kernels (K the row's shift), and shards merged at one
    n = want[Stat.NUMEL]
    d = want[Stat.MAX] - want[Stat.MIN] if np.isfinite(want[Stat.MAX] - want[Stat.MIN]) else 0.0
    s1 = np.sqrt(n * abs(want[Stat.SUMSQ])) + n * abs(want[Stat.SHIFT])
    tol = {Stat.SHIFT_SUM: s1,
           Stat.SHIFT_SUMSQ: abs(want[Stat.SHIFT_SUMSQ]) + 2 * d * s1 + n * d * d}
    for i, scale in tol.items():
        if not abs(got[i] - want[i]) <= rtol * scale + rtol:
            bad.append(Stat(i).name)
    return bad


def _compare(frames, expected: dict, rtol: float = 1e-12) -> dict:
    """expected: {(step, module, role): full tensor}. Returns mismatches and counts."""
    mism, seen, kinds = {}, 0, {}
    by_step = {f.step: f for f in frames}
    for (step, m, r), full in expected.items():
        f = by_step.get(step)
        i = f.index(m, r) if f is not None else None
        if i is None:
            mism[f"{step}:{m}:{r}"] = ["missing"]
            continue
        seen += 1
        kinds[f"{m}:{r}"] = KIND_NAMES[f.kinds[i]]
        bad = _row_mismatch(f.rows[i], full, rtol)
        if bad:
            mism[f"{step}:{m}:{r}"] = bad
    return {"mismatch": mism, "compared": seen, "kinds": kinds}


def fsdp2(rank, world, run_dir, steps=3, device="cpu", dist_backend="auto"):
    """Real FSDP2 (fully_shard) on CPU/gloo: merged rows of sharded weights, gradients and Adam
    state equal the rows of the unsharded tensors (fingerprints included)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5)).to(dev)   # 5: uneven
    mesh = init_device_mesh(device, (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sw.watch(model, opt, config=sw.Config(**QUIET, capture=(),
                                                     dist={"backend": dist_backend}),
                   run_dir=run_dir)
    frames = _keep_frames(mon)
    expected = {}
    params = [(n, pn, p) for n in ("0", "2") for pn, p in model.get_submodule(n).named_parameters()]
    role = sw_roles()
    for step, x in enumerate(_batches(rank, steps, (4, 8))):
        x = x.to(dev)
        for n, pn, p in params:   # full_tensor() is a collective: every rank calls it
            expected[(step, n, role(pn, "weight"))] = p.full_tensor()
        with mon.step(step, batch=x):
            loss = model(x).square().mean()
            loss.backward()
            for n, pn, p in params:
                expected[(step, n, role(pn, "grad"))] = p.grad.full_tensor()
            mon.observe_loss(loss)
            opt.step()
            for n, pn, p in params:
                for k in ("exp_avg", "exp_avg_sq"):
                    expected[(step, n, role(pn, f"optim.{k}"))] = opt.state[p][k].full_tensor()
            opt.zero_grad()
    mon.close()
    out = {**_common(mon), "is_dtensor": type(model[0].weight).__name__}
    if rank == 0:   # the GPU kernel adds float64 partial sums with atomics: last bits vary
        out.update(_compare(frames, expected, 1e-12 if device == "cpu" else 1e-9))
    return out


def sw_roles():
    from stabilitywatch.hooks.taps import param_role
    return param_role


class ShardHolder(nn.Module):
    """FSDP2-style by hand: DTensor parameters (uneven shard, an empty shard, a replica)."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        torch.manual_seed(1)
        self.full = {"weight": torch.randn(3, 5) * 100, "tiny": torch.randn(1, 4),
                     "rep": torch.randn(7)}
        self.weight = nn.Parameter(distribute_tensor(self.full["weight"], mesh, [Shard(0)]))
        self.tiny = nn.Parameter(distribute_tensor(self.full["tiny"], mesh, [Shard(0)]))
        self.rep = nn.Parameter(distribute_tensor(self.full["rep"], mesh, [Replicate()]))

    def forward(self, x):
        return x * 2


def dtensor_by_hand(rank, world, run_dir, flip_step=1, steps=3):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(ShardHolder(mesh))
    mon = sw.watch(model, config=sw.Config(**QUIET, capture=(),
                                           roles=(sw.Role.WEIGHT, sw.Role.OUTPUT)),
                   run_dir=run_dir)
    frames = _keep_frames(mon)
    holder = model[0]
    expected = {}
    for step, x in enumerate(_batches(rank, steps, (2, 3))):
        if rank == 1 and step == flip_step:
            _flip_lowest_bit(holder.rep.to_local(), 3)
        for name in ("weight", "tiny"):
            expected[(step, "0", name)] = holder.full[name]
        with mon.step(step, batch=x):
            model(x)
    mon.close()
    out = {**_common(mon), "local_shapes": {n: list(getattr(holder, n).to_local().shape)
                                            for n in ("weight", "tiny", "rep")}}
    if rank == 0:
        out.update(_compare(frames, expected))
    return out


# -- a rank that leaves, a rank that dies ---------------------------------------------------------
def rank_leaves(rank, world, run_dir, leave_after=2, steps=6, dist_backend="auto"):
    """Rank 1 closes its monitor early (its loop ended); rank 0 must go on without waiting for
    the collective timeout."""
    model = _mlp()
    cfg = sw.Config(**QUIET, dist={"divergence": False, "timeout": 20,
                                   "backend": dist_backend}, capture=())
    mon = sw.watch(model, config=cfg, run_dir=run_dir)
    t0 = time.monotonic()
    n = leave_after if rank == 1 else steps
    for step, x in enumerate(_batches(rank, n)):
        with mon.step(step, batch=x):
            model(x).square().mean().backward()
    mon.close()
    return {**_common(mon), "seconds_in_loop": time.monotonic() - t0}


def rank_dies(rank, world, run_dir, die_step=3, steps=6):
    """Rank 1 is killed inside a step; rank 0 must go on and leave intact files."""
    model = _mlp()
    cfg = sw.Config(**QUIET, dist={"divergence": False, "timeout": 5}, capture=())
    mon = sw.watch(model, config=cfg, run_dir=run_dir)
    t0 = time.monotonic()
    for step, x in enumerate(_batches(rank, steps)):
        with mon.step(step, batch=x):
            if rank == 1 and step == die_step:
                os._exit(17)
            model(x).square().mean().backward()
    mon.close()
    return {**_common(mon), "seconds_in_loop": time.monotonic() - t0, "no_barrier": True}
