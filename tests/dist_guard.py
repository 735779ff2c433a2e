"""Scenarios of tests/test_guard.py run on 2 gloo processes (spawned by the test)."""
import datetime
import json
import os
import traceback
from pathlib import Path


def entry(rank, world, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        res = guard_one_rank_nan(rank, Path(out))
        res["ok"] = True
    except BaseException:
        res = {"ok": False, "error": traceback.format_exc()}
    finally:
        (Path(out) / f"result.rank{rank}.json").write_text(json.dumps(res, default=str))
        dist.destroy_process_group()


def guard_one_rank_nan(rank, out):
    """Replicas with the same init and data (no DDP: each rank's gradients are its own); rank 1
    alone gets a NaN in one gradient at step 3 (unsampled). Both ranks must skip step 3."""
    import torch
    import torch.nn as nn
    import stabilitywatch as sw
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    cfg = sw.Config(every=10, warmup=0, guard={"on_nonfinite": "skip"}, sinks=("jsonl",),
                    dist={"timeout": 30})
    before = after = None
    with sw.watch(model, opt, config=cfg, run_dir=out / "run") as mon:
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
            if step == 3:
                after = [p.detach().clone() for p in model.parameters()]
    weights = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    return {"unchanged_at_3": all(torch.equal(a, b) for a, b in zip(before, after)),
            "weights": weights, "windows": mon.schedule.windows,
            "alerts": [a.to_dict() for a in mon.alerts]}
