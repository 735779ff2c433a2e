"""Scenarios on a tiny HF GPT-2 under DDP and FSDP2 (gloo, CPU), and the flush's payload at
several world sizes; run on every rank by tests/distutil.run_ranks (test_distributed_gpt2.py,
test_distributed_scale.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import stabilitywatch as sw

BLOCK = "transformer.h.1.mlp.c_fc"      # Conv1D weight [n_embd, 4 n_embd]: dim 0 is sharded


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _wrap(model, wrap: str, world: int, dev: torch.device):
    """(module to call, prefix of the names the monitor sees)."""
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        return ddp, "module."
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(dev.type, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(_local(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _batches(rank: int, n: int, dev: torch.device):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 96, (2, 16), generator=g).to(dev) for _ in range(n)]


def _device(device: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def gpt2_nan(rank, world, run_dir, wrap="ddp", nan_step=5, steps=8, device="cpu", dist_backend="auto"):
    """A NaN in rank 1's shard of one gradient on an unsampled step, the guard on: both ranks
    skip that step; rank 0's incident names rank 1, the module, the role (and the shard)."""
    dev = _device(device, rank)
    model = _gpt2().to(dev)
    net, prefix = _wrap(model, wrap, world, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sw.Config(sinks=("jsonl",), every=4, warmup=0, capture=(), guard={"on_nonfinite": "skip"},
                    dist={"timeout": 60, "backend": dist_backend})
    mon = sw.watch(net, opt, config=cfg, run_dir=run_dir)
    target = model.get_submodule(BLOCK).weight
    before = after = None
    for step, ids in enumerate(_batches(rank, steps, dev)):
        if step == nan_step:
            before = _digest(model)
        with mon.step(step, batch=ids):
            loss = net(ids, labels=ids).loss
            loss.backward()
            mon.observe_loss(loss)
            if step == nan_step and rank == 1:
                with torch.no_grad():
                    _local(target.grad)[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
        if step == nan_step:
            after = _digest(model)
    mon.close()
    finite = all(bool(torch.isfinite(_local(p.detach())).all())   # sync-ok: after the run
                 for p in model.parameters())
    return {"alerts": [a.to_dict() for a in mon.alerts], "unchanged_at_nan": before == after,
            "path": getattr(mon.dist, "path", None),
            "digest": _digest(model), "finite": finite, "module": prefix + BLOCK,
            "local_shape": list(_local(target.detach()).shape)}


def gpt2_bitflip(rank, world, run_dir, wrap="ddp", flip_step=3, steps=5, device="cpu", dist_backend="auto"):
    """A flipped exponent bit in rank 1's copy (DDP) or shard (FSDP2) of one weight."""
    dev = _device(device, rank)
    model = _gpt2().to(dev)
    net, prefix = _wrap(model, wrap, world, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sw.Config(sinks=("jsonl",), every=1, warmup=0, capture=(),
                    dist={"timeout": 60, "backend": dist_backend})
    mon = sw.watch(net, opt, config=cfg, run_dir=run_dir)
    target = model.get_submodule(BLOCK).weight
    for step, ids in enumerate(_batches(rank, steps, dev)):
        if step == flip_step and rank == 1:
            with torch.no_grad():
                _local(target.data).view(-1).view(torch.int32)[3] ^= 1 << 30
        with mon.step(step, batch=ids):
            loss = net(ids, labels=ids).loss
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    mon.close()
    return {"alerts": [a.to_dict() for a in mon.alerts], "module": prefix + BLOCK}


# -- the payload at several world sizes ----------------------------------------------------------
def payload(rank, world, run_dir, steps=4, dist_backend="auto"):
    """The same DDP run with the reduction and with the all-gather: bytes this rank sent per
    flush, and (rank 0) the merged records of both."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    for merge in ("reduce", "gather"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        cfg = sw.Config(sinks=("jsonl",), every=1, warmup=0, capture=(),
                        dist={"merge": merge, "timeout": 60, "backend": dist_backend})
        d = Path(run_dir) / merge
        mon = sw.watch(ddp, opt, config=cfg, run_dir=d)
        g = torch.Generator().manual_seed(1000 + rank)
        sent = []
        for step in range(steps):
            x = torch.randn(8, 16, generator=g)
            b0 = mon.dist.bytes_sent
            with mon.step(step, batch=x):
                loss = ddp(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
            sent.append(mon.dist.bytes_sent - b0)
        mon.close()
        out[merge] = {"sent": sent, "collectives": mon.dist.collectives,
                      "path": getattr(mon.dist, "path", None)}
        if rank == 0:
            recs = [json.loads(line) for line in (d / "stats.jsonl").read_text().splitlines()]
            out[merge]["records"] = {f"{r['step']}:{r['module']}:{r['tensor']}": r["stats"]
                                     for r in recs}
    return out


def close_enough(a: dict, b: dict, rtol: float = 1e-9) -> list:
    """Keys of two records' statistics that differ (NaN equal to NaN)."""
    bad = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if not (x == y or (np.isnan(x) and np.isnan(y))
                    or abs(x - y) <= rtol * max(abs(x), abs(y), 1e-300)):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad
