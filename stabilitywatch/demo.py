"""The demo: a small GPT-style model on synthetic data, bf16 autocast, with a fault injected at a
known step into one named layer. Its weights are scaled so that its output saturates E4M3, then
scaled again so that the output overflows to Inf. The monitor must name the step and module."""
from __future__ import annotations

import logging
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Config
from .monitor import watch
from .stats import cpu_jit

log = logging.getLogger("stabilitywatch")

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 128, 64, 2, 4, 32, 8
FAULT_MODULE = "blocks.1.mlp.fc1"


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, seq=SEQ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_model() -> TinyGPT:
    """model_factory for captures/replay: the demo's model with the demo's seed."""
    torch.manual_seed(0)
    return TinyGPT()


def make_batch(gen: torch.Generator, device: str) -> dict:
    # a learnable synthetic language: each token is the previous one times 3 plus 1, with noise
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    steps = torch.arange(SEQ + 1).view(1, -1)
    seq = (start * (3 ** steps) + (3 ** steps - 1) // 2) % VOCAB
    noise = torch.rand(seq.shape, generator=gen) < 0.05
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)
    return {"idx": seq[:, :-1].to(device), "target": seq[:, 1:].to(device)}


def train_step(model: nn.Module, batch: dict) -> torch.Tensor:
    """step_fn for captures/replay: forward and loss under bf16 autocast."""
    device = batch["idx"].device.type
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    return F.cross_entropy(logits.float().view(-1, VOCAB), batch["target"].reshape(-1))


# what the demo records in its captures, and names again on replay's command line (replay runs
# only code the user names: README "Trust model")
MODEL_FACTORY = "stabilitywatch.demo:build_model"
STEP_FN = "stabilitywatch.demo:train_step"


def replay_command(capture: "str | Path") -> str:
    return (f"stabilitywatch replay {shlex.quote(str(capture))} --model-factory {MODEL_FACTORY} "
            f"--step-fn {STEP_FN}")


@dataclass
class DemoResult:
    run_dir: Path
    steps: int
    fault_step: int
    inf_step: int
    fault_module: str
    ms_per_step: float
    alerts: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    # the same steps without the monitor, run just before (run_demo(baseline=True))
    ms_per_step_unmonitored: Optional[float] = None
    # the training thread's own CPU time per step (time.thread_time), the monitor's close() in
    cpu_ms_per_step: Optional[float] = None


# read at the default cadence, not every step: the faults are caught in the weights and outputs
SPARSE_ROLES = {"grad_output": 10, "grad": 10, "optim": 10}


def demo_config() -> Config:
    # outputs judged as if cast to E4M3 (the FP8 forward format). The faults are weight writes:
    # the physics check sees them in weights read on consecutive steps, the overflow and
    # non-finite checks in the outputs, so both are read every step; the gradients (their
    # NaN/Inf and norms are the sentinel's every step), the outputs' gradients and the optimizer
    # state every 10th step, and every role once an alert has fired (escalation). The faulty
    # steps are not skipped, so the walk-through's bundles take their start-of-step state from
    # the "sampled" snapshots (a small model: cheap here)
    return Config(every=1, role_every=SPARSE_ROLES, formats={"output": "e4m3"},
                  sinks=("jsonl", "console"), capture={"snapshot": "sampled"})


def run_demo(out: "str | Path" = "runs/demo", device: Optional[str] = None, steps: int = 40,
             fault_step: int = 25, monitor: bool = True,
             config: Optional[Config] = None, baseline: bool = False) -> DemoResult:
    """Train the demo model for `steps` steps; baseline=True first runs the same steps without
    the monitor, for the step time it costs (both in the result)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if monitor and device == "cpu":
        # the CPU statistics' compiled loops (numba): compiled once, seconds, then cached on
        # disk; a monitor answers with numpy passes until they are ready, and the demo times
        # steps, so it waits for them before any timed step
        cpu_jit.wait()
    base = (run_demo(out, device, steps, fault_step, monitor=False).ms_per_step
            if baseline and monitor else None)
    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    inf_step = fault_step + 3
    target = model.get_submodule(FAULT_MODULE)
    mon = (watch(model, opt, config=config or demo_config(), run_dir=out,
                 model_factory=MODEL_FACTORY, step_fn=STEP_FN) if monitor else None)
    losses, t0, c0 = [], time.perf_counter(), time.thread_time()
    try:
        for step in range(steps):
            batch = make_batch(gen, device)
            with torch.no_grad():
                if step == fault_step:    # saturates E4M3 (and fp16) in this layer's output
                    target.weight.mul_(2e3)
                elif step == inf_step:    # weights stay finite, the output overflows: Inf
                    target.weight.mul_(1e38 / target.weight.abs().max())
            ctx = mon.step(step, batch=batch) if mon else _null()
            with ctx:
                loss = train_step(model, batch)
                loss.backward()
                if mon:
                    mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    finally:
        if mon:
            mon.close()
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    cpu_ms = (time.thread_time() - c0) * 1e3 / steps
    # mon.run_dir: where the run wrote (a sibling of `out` when `out` held a run already)
    return DemoResult(mon.run_dir if mon else Path(out), steps, fault_step, inf_step,
                      FAULT_MODULE, ms, list(mon.alerts) if mon else [],
                      [float(x) for x in losses], base, cpu_ms)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def summary(r: DemoResult) -> str:
    lines = [f"demo: fault injected into {r.fault_module} at step {r.fault_step} "
             f"(weights x2e3, E4M3 saturation) and step {r.inf_step} (weights up to 1e38: Inf output)"]
    for a in r.alerts:
        if a.severity.value != "info":
            lines.append(f"  step {a.step:>3} {a.severity.value:<8} {a.detector:<9} "
                         f"{a.module or '<model>'} {a.tensor} {a.stat}={a.value:.4g}")
    first = next((a for a in r.alerts if a.severity.value != "info"), None)
    if first is not None:
        hit = first.step == r.fault_step and first.module == r.fault_module
        lines.append(f"first alert: step {first.step}, module {first.module or '<model>'} -> "
                     + ("caught at the injected step and module" if hit else "NOT the injected fault"))
    else:
        lines.append("no alert was raised")
    finite = [x for x in r.losses if math.isfinite(x)]
    lines.append(f"{r.steps} steps, {r.ms_per_step:.1f} ms/step; last finite loss "
                 f"{finite[-1]:.3f}" if finite else f"{r.steps} steps")
    if r.ms_per_step_unmonitored:
        lines.append(f"step time: {r.ms_per_step:.1f} ms monitored, {r.ms_per_step_unmonitored:.1f} "
                     f"ms unmonitored ({r.ms_per_step / r.ms_per_step_unmonitored:.2f}x)")
    lines.append(f"run directory: {r.run_dir.resolve()} (alerts.jsonl, stats.jsonl, run.json)")
    caps = sorted({a.capture for a in r.alerts if a.capture})
    for c in caps:  # bundles of the flagged steps: see README "Post-mortem: capture and replay"
        lines.append(f"capture: {c}  ->  {replay_command(r.run_dir / c)}")
    return "\n".join(lines)
