"""Step-time overhead of the monitor on a GPT-2-small-shaped model, against what users would
otherwise do, all in one run:

    python benchmarks/bench_overhead.py            # GPU: 12 layers, d 768, vocab 50304, seq 1024,
                                                   # batch 16, bf16 autocast, fused AdamW
    python benchmarks/bench_overhead.py --smoke    # CPU: tiny shapes (the test suite runs this)

Configurations: no monitor; the monitor's default config (with the every-step gradient sentinel
and the optimizer-update rows; `--configs` also takes the default config without either, and
with the guard); full coverage every step (every
Linear output and output gradient, weights, weight gradients); naive forward/backward hooks with
ten eager reductions read with .item(); torch.autograd.detect_anomaly. ms/step is the mean over
the timed window (one sync at its end, as in training), so the default config's sampled steps
(every 10th) count at their full cost; the window starts between two of them (a sampled step
right after the synchronize would pay its host work in full, which a running loop hides behind
the GPU's queue). The floor is the bytes full coverage reads once per step
over the read bandwidth of a large torch.sum.
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import stabilitywatch as sw
from stabilitywatch.demo import TinyGPT


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(vocab=256, dim=64, layers=2, heads=4, seq=32, batch=2, steps=4, warm=2)
    # the window (steps 15..44) holds three sampled steps of the default config (20, 30, 40) and
    # starts between two of them: a window that began with a sampled step right after the
    # synchronize charged that step's host work, which a running loop overlaps with the GPU
    return dict(vocab=50304, dim=768, layers=12, heads=12, seq=1024, batch=16, steps=30, warm=15)


def naive_hooks(model: nn.Module) -> list:
    """What a user writes by hand: ten reductions per tensor, each read back with .item()."""
    def stats(t):
        t = t.detach().float()
        return [t.min().item(), t.max().item(), t.abs().max().item(), t.mean().item(),
                t.std().item(), t.norm().item(), t.isnan().sum().item(), t.isinf().sum().item(),
                (t == 0).sum().item(), (t.abs() > 448).sum().item()]

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(lambda mod, a, o: (stats(o), None)[1]))
            handles.append(m.register_full_backward_hook(
                lambda mod, gi, go: (stats(go[0]), None)[1]))
    return handles


def full_coverage(snapshots: bool = True) -> sw.Config:
    """Statistics of every Linear output, output gradient, weight and weight gradient at every
    step. With the default capture policy that also keeps a snapshot of every step (weights,
    optimizer state: ~1.5 GB here, to pinned host memory); snapshots=False measures the
    statistics alone."""
    return sw.Config(every=1, module_types=(nn.Linear,), sinks=("jsonl",),
                     roles=(sw.Role.OUTPUT, sw.Role.GRAD_OUTPUT, sw.Role.WEIGHT, sw.Role.GRAD,
                            sw.Role.LOSS),
                     capture={"snapshot": "sampled" if snapshots else "off"})


def build(s: dict, device: str) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """The benchmark model, its optimizer and the one batch every step reuses (also
    bench_capture.py's gpt2 model)."""
    torch.manual_seed(0)
    model = TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    idx = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), device=device)
    return model, opt, {"idx": idx[:, :-1], "target": idx[:, 1:]}


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Forward under bf16 autocast and the loss in fp32."""
    with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["target"].reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict, mon, step: int) -> None:
    """One step of the benchmark loop, monitored when mon is a Monitor (else None)."""
    with (mon.step(step, batch=batch) if mon else _null()):
        loss = loss_fn(model, batch)
        loss.backward()
        if mon:
            mon.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def run(kind: str, s: dict, device: str, out: str) -> tuple[float, float, str]:
    # the previous configuration's model, optimizer and monitor hold each other in reference
    # cycles: collect them, or their memory counts in this configuration's peak
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left > 2**20:
            print(f"# {kind}: {left / 2**20:.0f} MiB still allocated before the run")
    model, opt, batch = build(s, device)
    mon, handles = None, []
    if kind == "default config":
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",)), run_dir=out)
    elif kind == "default config without capture":  # the parts of the default config's cost
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",), capture=()), run_dir=out)
    elif kind == "default config without sinks":
        mon = sw.watch(model, opt, config=sw.Config(sinks=()), run_dir=out)
    elif kind == "default config without sentinel":   # the every-step sentinel's share
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",), sentinel=False),
                       run_dir=out)
    elif kind == "default config without update stats":   # the optim.update rows' share
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",), update={"stats": False}),
                       run_dir=out)
    elif kind == "default config with the guard":
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",),
                                                    guard={"on_nonfinite": "skip"}),
                       run_dir=out)
    elif kind == "full coverage, every step":
        mon = sw.watch(model, opt, config=full_coverage(), run_dir=out)
    elif kind == "full coverage, no snapshots":
        mon = sw.watch(model, opt, config=full_coverage(False), run_dir=out)
    elif kind == "naive hooks + .item()":
        handles = naive_hooks(model)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = 0.0
    for step in range(s["warm"] + s["steps"]):
        if step == s["warm"]:  # time the window as a whole: sampled steps cost what they cost
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        anomaly = torch.autograd.detect_anomaly(check_nan=True) if kind == "detect_anomaly" else _null()
        with anomaly:
            train_step(model, opt, batch, mon, step)
    if device == "cuda":
        torch.cuda.synchronize()
    mean_ms = (time.perf_counter() - t0) * 1e3 / s["steps"]
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    seen = ""
    if mon:
        mon.close()
        captures = sum(1 for a in mon.alerts if a.capture)
        kinds = collections.Counter(f"{a.detector}:{a.severity.value}" for a in mon.alerts)
        seen = f"{len(mon.alerts)} / {captures} " + ", ".join(f"{k} x{n}" for k, n in kinds.items())
    for h in handles:
        h.remove()
    return mean_ms, peak, seen


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def floor_ms(s: dict, device: str) -> float:
    """Bytes full coverage reads once per step (bf16 outputs and output grads of every Linear,
    fp32 weights and grads) over the bandwidth of a large torch.sum."""
    torch.manual_seed(0)
    model = TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
    tokens = s["batch"] * s["seq"]
    act = sum(m.out_features for m in model.modules() if isinstance(m, nn.Linear)) * tokens * 2 * 2
    par = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
              for m in model.modules() if isinstance(m, nn.Linear)) * 4 * 2
    x = torch.randn(1 << (28 if device == "cuda" else 22), device=device)
    x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    bw = 10 * 4 * x.numel() / (time.perf_counter() - t0)  # bytes/s
    return (act + par) / bw * 1e3


KINDS = ["no monitor", "default config", "full coverage, every step", "naive hooks + .item()",
         "detect_anomaly", "default config without capture", "default config without sinks",
         "full coverage, no snapshots", "default config without sentinel",
         "default config without update stats", "default config with the guard"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--configs", default=";".join(KINDS[:5]),
                   help=f"separated by ;, from: {'; '.join(KINDS)}")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the configurations (interleaved, so that a slow spell of "
                        "the host falls on all of them); the table gives the median round and "
                        "the range of the overhead")
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.configs.split(";")]
    if "no monitor" not in kinds or any(k not in KINDS for k in kinds):
        p.error(f"--configs: choose from {KINDS}, including 'no monitor' (the baseline)")
    if a.repeats < 1:
        p.error("--repeats: at least 1")
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    s = shapes(a.smoke or device == "cpu")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            rounds.append({kind: run(kind, s, device, f"{tmp}/{r}-{i}")
                           for i, kind in enumerate(kinds)})
    # each round's overhead against the same round's baseline, then the median round
    over = {k: sorted(rd[k][0] / rd["no monitor"][0] - 1 for rd in rounds) for k in kinds}
    res = {k: sorted((rd[k] for rd in rounds), key=lambda v: v[0])[len(rounds) // 2]
           for k in kinds}
    base, base_mem, _ = res["no monitor"]
    fl = floor_ms(s, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"# bench_overhead on {name}: {s}; read-once floor of full coverage {fl:.2f} ms "
          f"({fl / base:.1%} of the step); {a.repeats} round(s)")
    print("| configuration | ms/step | ratio | overhead | overhead range | peak MiB | peak ratio "
          "| peak ratio range | alerts / captures |")
    print("|---|---:|---:|---:|---|---:|---:|---|---|")
    for kind, (ms, mem, seen) in res.items():
        lo, hi = over[kind][0], over[kind][-1]
        peaks = sorted(rd[kind][1] / rd["no monitor"][1] for rd in rounds)
        print(f"| {kind} | {ms:.2f} | {ms / base:.3f}x | {(ms - base) / base:+.1%} | "
              f"{lo:+.1%} .. {hi:+.1%} | {mem:.0f} "
              f"| {mem / base_mem if base_mem == base_mem else float('nan'):.3f} "
              f"| {peaks[0]:.3f} .. {peaks[-1]:.3f} | {seen} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
