"""HF GPT-2 small (from its config) on two GPUs over NCCL, DDP and FSDP2 (`fully_shard`): the
guard, the incidents and the divergence and physics checks, and the cost of the sentinel's
cross-rank reduction per step.

    torchrun --standalone --nproc_per_node=2 benchmarks/dist_nccl.py [--steps 30] [--out DIR]
    python benchmarks/dist_nccl.py --smoke [--out DIR]    # 2 gloo processes, CPU, a tiny GPT-2

Scenarios (each a fresh model, the same seed on both ranks, batches per rank):
- nan/ddp, nan/fsdp2: `Config(guard={"on_nonfinite": "skip"}, every=4)`; at step 5 (unsampled) rank 1
  writes a NaN into its gradient (its shard under FSDP2) of transformer.h.1.mlp.c_fc.weight
  before the optimizer step. Checked: both ranks' parameters are unchanged by step 5, DDP
  replicas are bit-identical at the end, rank 0's critical alert at step 5 names rank 1, the
  module and the role (FSDP2: and the shard's rows).
- flip/ddp, flip/fsdp2: before step 3 rank 1 flips bit 30 (exponent) of one element of its copy
  (shard) of that weight. Checked: `divergence` names rank 1 under DDP, `physics` under FSDP2.
- cost: DDP, interleaved: no monitor, `Config()`, `Config(guard={"on_nonfinite": "skip"})` (the guard's
  flag all-reduced across ranks every step); median ms/step, and per step the host time of the
  flag's all-reduce call and the device time of the NCCL kernel (CUDA events around it).
Prints a markdown table last; with --out writes dist_nccl.json and dist_nccl.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import stabilitywatch as sw  # noqa: E402

BLOCK = "transformer.h.1.mlp.c_fc"


def gpt2(tiny: bool, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    kw = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32) if tiny else {}
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    return GPT2LMHeadModel(cfg).to(device), cfg.vocab_size


def wrap(model, how: str, device):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), "module."
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ""


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(local(p.detach()).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def batches(a, vocab, device, n):
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device) for _ in range(n)]


def amp(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def scenario(kind: str, how: str, a, device, run_dir) -> dict:
    rank = dist.get_rank()
    model, vocab = gpt2(a.tiny, device)
    net, prefix = wrap(model, how, device)
    # fused AdamW on CUDA under DDP (the guard without a host read); FSDP2's DTensor
    # parameters take the default implementation (the guard reads its flag on the host)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3,
                            fused=device.type == "cuda" and how == "ddp")
    if kind == "nan":
        cfg = sw.Config(sinks=("jsonl",), every=4, warmup=0, capture=(), guard={"on_nonfinite": "skip"})
        at = 5
    else:
        cfg = sw.Config(sinks=("jsonl",), every=1, warmup=0, capture=())
        at = 3
    mon = sw.watch(net, opt, config=cfg, run_dir=run_dir)
    target = model.get_submodule(BLOCK).weight
    before = after = None
    for step, ids in enumerate(batches(a, vocab, device, at + 3)):
        if kind == "flip" and step == at and rank == 1:
            with torch.no_grad():
                local(target.data).view(-1)[:1].view(torch.int32)[0] ^= 1 << 30
        if step == at:
            before = digest(model)
        with mon.step(step, batch=ids):
            with amp(device):
                loss = net(ids, labels=ids).loss
            loss.backward()
            mon.observe_loss(loss)
            if kind == "nan" and step == at and rank == 1:
                with torch.no_grad():
                    local(target.grad).view(-1)[0] = float("nan")
            opt.step()
            opt.zero_grad()
        if step == at:
            after = digest(model)
    mon.close()
    res = {"scenario": f"{kind}/{how}", "rank": rank, "module": prefix + BLOCK,
           "digest": digest(model), "unchanged": before == after,
           "alerts": [x.to_dict() for x in mon.alerts]}
    del net, model, opt
    return res


def judge(res: list) -> tuple[bool, str]:
    r0, r1 = res
    kind, how = r0["scenario"].split("/")
    al = r0["alerts"]
    if kind == "nan":
        nf = [x for x in al if x["detector"] == "nonfinite" and x["step"] == 5]
        ok = bool(nf) and r0["unchanged"] and r1["unchanged"]
        if how == "ddp":
            ok = ok and r0["digest"] == r1["digest"]
        if nf:
            x = nf[0]
            ok = ok and (x["rank"], x["module"], x["tensor"]) == (1, r0["module"], "grad") \
                and x["extra"].get("skipped") is True
            if how == "fsdp2":
                ok = ok and x["extra"].get("shard", {}).get("rank") == 1
        return ok, nf[0]["message"] if nf else "no non-finite alert at step 5"
    det = "divergence" if how == "ddp" else "physics"
    hit = [x for x in al if x["detector"] == det and x["step"] == 3
           and (x["module"], x["tensor"]) == (r0["module"], "weight")]
    ok = bool(hit) and hit[0]["rank"] == 1
    return ok, hit[0]["message"] if hit else f"no {det} alert at step 3"


def cost(a, device, tmp) -> list:
    """ms/step and the flag's all-reduce, interleaved configurations."""
    rows = []
    cfgs = {"no monitor": None, "Config()": sw.Config(sinks=("jsonl",), capture=()),
            "Config(guard={'on_nonfinite': 'skip'})": sw.Config(sinks=("jsonl",), capture=(),
                                                      guard={"on_nonfinite": "skip"})}
    for rep in range(a.repeats):
        for name, cfg in cfgs.items():
            model, vocab = gpt2(a.tiny, device)
            net, _ = wrap(model, "ddp", device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            mon = sw.watch(net, opt, config=cfg, run_dir=Path(tmp) / f"cost{rep}{len(rows)}") \
                if cfg is not None else None
            host, events = [], []
            xr = mon.control.xrank if mon is not None else None
            if xr is not None:
                inner = xr.reduce

                def timed(flag, bad=None, inner=inner):
                    t0 = time.perf_counter()
                    if device.type == "cuda":
                        e0, e1 = torch.cuda.Event(enable_timing=True), \
                            torch.cuda.Event(enable_timing=True)
                        e0.record()
                        out = inner(flag, bad)
                        e1.record()
                        events.append((e0, e1))
                    else:
                        out = inner(flag, bad)
                    host.append(time.perf_counter() - t0)
                    return out
                xr.reduce = timed
            times = []
            data = batches(a, vocab, device, 4)
            for step in range(a.warmup + a.steps):
                ids = data[step % 4]
                t0 = time.perf_counter()
                ctx = mon.step(step, batch=ids) if mon is not None else _Null()
                with ctx:
                    with amp(device):
                        loss = net(ids, labels=ids).loss
                    loss.backward()
                    if mon is not None:
                        mon.observe_loss(loss)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step >= a.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if mon is not None:
                mon.close()
            dev = [e0.elapsed_time(e1) for e0, e1 in events[a.warmup:]] if events else []
            rows.append({"config": name, "ms_step": statistics.median(times),
                         "flag_host_us": statistics.median(host[a.warmup:]) * 1e6
                         if len(host) > a.warmup else 0.0,
                         "flag_device_us": statistics.median(dev) * 1e3 if dev else 0.0})
            del net, model, opt
            dist.barrier()
    return rows


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False


def table(verdicts: list, rows: list, a, device) -> str:
    by: dict = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    base = statistics.median(r["ms_step"] for r in by["no monitor"])
    what = (f"{'tiny GPT-2' if a.tiny else 'GPT-2 small'}, batch {a.batch} x {a.seq}, "
            f"{dist.get_world_size()} ranks, {dist.get_backend()}, {device.type}")
    out = [f"Scenarios ({what})", "", "| scenario | verdict | rank 0's alert |", "|---|---|---|"]
    for name, ok, msg in verdicts:
        out.append(f"| {name} | {'PASS' if ok else 'FAIL'} | {msg[:160]} |")
    out += ["", f"Cost per step ({what}; median of {a.steps} steps x {a.repeats})", "",
            "| configuration | ms/step | vs no monitor | flag all-reduce host us | "
            "flag all-reduce device us |", "|---|---:|---:|---:|---:|"]
    for name, rs in by.items():
        ms = statistics.median(r["ms_step"] for r in rs)
        rel = f"{(ms / base - 1) * 100:+.1f}%" if name != "no monitor" else "-"
        h = statistics.median(r["flag_host_us"] for r in rs)
        d = statistics.median(r["flag_device_us"] for r in rs)
        out.append(f"| {name} | {ms:.2f} | {rel} | {h:.1f} | {d:.1f} |")
    return "\n".join(out)


def worker(a) -> None:
    cuda = torch.cuda.is_available() and not a.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    verdicts, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("nan", "flip"):
            for how in ("ddp", "fsdp2"):
                res = scenario(kind, how, a, device, Path(tmp) / f"{kind}_{how}")
                got: list = [None] * dist.get_world_size()
                dist.all_gather_object(got, res)
                ok, msg = judge(got)
                verdicts.append((f"{kind}/{how}", ok, msg))
                results.append(got)
        rows = cost(a, device, tmp)
    if dist.get_rank() == 0:
        text = table(verdicts, rows, a, device)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "dist_nccl.json").write_text(json.dumps(
                {"verdicts": verdicts, "cost": rows, "scenarios": results}, default=str))
            (out / "dist_nccl.md").write_text(text + "\n")
        print(text, flush=True)
    dist.destroy_process_group()


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="2 gloo processes on the CPU, tiny sizes")
    a = p.parse_args(argv)
    a.tiny = a.smoke
    if a.smoke:
        a.steps, a.warmup, a.repeats, a.batch, a.seq = 3, 1, 1, 2, 16
    return a


def _spawned(rank, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    worker(parse(argv))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.smoke and "RANK" not in os.environ:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(port, argv), nprocs=2, start_method="spawn")
        return
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --standalone --nproc_per_node=2 "
              "benchmarks/dist_nccl.py (or --smoke)", file=sys.stderr)
        sys.exit(2)
    worker(a)


if __name__ == "__main__":
    main()
