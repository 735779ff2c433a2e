"""The zoo: small, seeded, CPU-fast training runs with one known instability each.

Every scenario returns a `Run`: the monitor's alerts, the losses, the step of the fault and the
(detector, module, tensor) the monitor should name first. tests/zoo/test_zoo.py asserts on them;
tests/zoo/README.md tabulates fault step, first alert and lead time.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import stabilitywatch as sw


@dataclass
class Run:
    name: str
    fault_step: int
    expect: tuple                     # (detector, module, tensor) of the first loud alert
    allowed: set                      # every loud root's (detector, module, tensor) (globs)
    window: tuple                     # (first, last) step where the first loud alert may land
    alerts: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    event_step: "int | None" = None   # the harm the alert should precede (saturation, divergence)

    @property
    def loud(self) -> list:
        """The roots of the incidents of warning or worse (consequences are listed in them)."""
        return [a for a in self.alerts if a.root and a.severity.value != "info"]


def config(**kw) -> sw.Config:
    return sw.Config(**{"every": 1, "warmup": 0, "sinks": ("jsonl",), **kw})


class MLP(nn.Module):
    """fc1 -> LayerNorm -> GELU -> fc2 -> GELU -> fc3: the LayerNorm keeps a fault in fc1 local."""

    def __init__(self, d_in=16, d=64, d_out=4):
        super().__init__()
        self.fc1, self.ln = nn.Linear(d_in, d), nn.LayerNorm(d)
        self.fc2, self.fc3 = nn.Linear(d, d), nn.Linear(d, d_out)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.ln(self.fc1(x))))))


def regression_data(seed=1, d_in=16, d_out=4, batch=32, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)

    def batch_at(step):
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        x = torch.randn(batch, d_in, generator=gs)
        return x, torch.tanh(x @ teacher) + noise * torch.randn(batch, d_out, generator=gs)
    return batch_at


def train(model, opt, cfg, run_dir, steps, batch_at, loss_fn=F.mse_loss, before=None,
          after_backward=None, autocast=None, stop_when=None):
    """The loop of the README. `before(step)` / `after_backward(step)` inject faults;
    `stop_when(step, loss)` ends a run that has diverged."""
    losses = []
    mon = sw.watch(model, opt, config=cfg, run_dir=run_dir)
    with mon:
        for step in range(steps):
            if before:
                before(step)
            x, y = batch_at(step)
            with mon.step(step, batch=x):
                ctx = (torch.autocast("cpu", dtype=autocast) if autocast
                       else contextlib.nullcontext())
                with ctx:
                    out = model(x)
                loss = loss_fn(out.float(), y)
                loss.backward()
                if after_backward:
                    after_backward(step)
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))   # outside the monitored step
            if stop_when and stop_when(step, losses[-1]):
                break
    return mon.alerts, losses


# -- 1. fp16 overflow in one layer --------------------------------------------------------------
def fp16_overflow(run_dir, steps=40, fault=25) -> Run:
    """From step `fault` the inputs of fc1 carry one feature scaled by 1e5 (a unit bug in one
    data column): fc1's output exceeds the fp16 max 65504; the LayerNorm after it keeps the rest
    of the network in range."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = regression_data()

    def batch_at(step):
        x, y = data(step)
        if step >= fault:
            x = x.clone()
            x[:, 3] *= 1e5
        return x, y
    alerts, losses = train(model, opt, config(formats={"output": "fp16"}), run_dir, steps, batch_at)
    # the root is the batch (its column jumped 16 bits), the overflow in fc1 its consequence
    return Run("fp16 overflow in one layer", fault, ("drift", "", "input"),
               {("drift", "", "input")}, (fault, fault), alerts, losses)


# -- 2. NaN injected into one gradient ----------------------------------------------------------
def nan_gradient(run_dir, steps=30, fault=20) -> Run:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def poison(step):
        if step == fault:
            model.fc2.weight.grad[5, 7] = float("nan")
    alerts, losses = train(model, opt, config(), run_dir, steps, regression_data(),
                           after_backward=poison)
    return Run("NaN injected into one gradient", fault, ("nonfinite", "fc2", "grad"),
               {("nonfinite", "fc2", "grad")}, (fault, fault), alerts, losses)


# -- 3. E4M3 saturation from an outlier feature that grows step by step -----------------------
def e4m3_outlier_growth(run_dir, steps=70, fault=20) -> Run:
    """From step `fault` one input feature grows x1.2 per step (a drifting sensor column):
    fc1's output grows with it. The time-to-overflow forecast must warn before E4M3 saturates."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    data = regression_data()

    def batch_at(step):
        x, y = data(step)
        if step >= fault:
            x = x.clone()
            x[:, 3] *= 1.2 ** (step - fault + 1)
        return x, y
    alerts, losses = train(model, opt, config(formats={"output": "e4m3"}), run_dir, steps,
                           batch_at)
    over = [a.step for a in alerts if a.detector == "overflow"]
    run = Run("E4M3 saturation from a growing outlier feature", fault,
              ("drift", "fc1", "output"),
              {("drift", "fc1", "output"), ("overflow", "fc1", "output")},
              (fault + 1, (over[0] - 1) if over else steps), alerts, losses)
    run.event_step = over[0] if over else None
    return run


# -- 4. E5M2 gradient underflow -------------------------------------------------------------------
def e5m2_grad_underflow(run_dir, steps=40, fault=25) -> Run:
    """From step `fault` fc1's weight gradient is divided by 1e5 (a wrong per-group loss-scale
    factor): most of it rounds to zero in E5M2."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"on": False}
    model.fc1.weight.register_hook(lambda g: g * 1e-5 if state["on"] else g)

    def switch(step):
        state["on"] = step >= fault
    alerts, losses = train(model, opt, config(formats={"grad*": "e5m2"}), run_dir, steps,
                           regression_data(), before=switch)
    return Run("E5M2 gradient underflow", fault, ("underflow", "fc1", "grad"),
               {("underflow", "fc1", "grad")}, (fault, fault), alerts, losses)


# -- 5. a loss spike from a learning-rate spike --------------------------------------------------
def classification_data(seed=1, d_in=16, k=8, batch=128):
    """Labels drawn from a softmax teacher: the loss floor is its entropy (~1.3 nats), as in
    language modelling, where gradients react to damage long before the loss doubles."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, k, generator=g) * (2 / math.sqrt(d_in))

    def batch_at(step):
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        x = torch.randn(batch, d_in, generator=gs)
        return x, torch.multinomial(torch.softmax(x @ teacher, -1), 1, generator=gs)[:, 0]
    return batch_at


def lr_spike(run_dir, steps=60, fault=50) -> Run:
    """A scheduler bug multiplies the learning rate by 4 every step from step `fault` (Adam).
    The update norm and the global gradient norm must spike before the loss does."""
    torch.manual_seed(0)
    model = MLP(d_out=8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def schedule(step):
        for g in opt.param_groups:
            g["lr"] = 3e-3 * (4.0 ** max(0, step - fault + 1))
    alerts, losses = train(model, opt, config(), run_dir, steps, classification_data(),
                           loss_fn=F.cross_entropy, before=schedule,
                           stop_when=lambda s, l: not math.isfinite(l) or l > 1e3)
    loss_alerts = [a.step for a in alerts if a.tensor == "loss" and a.severity.value != "info"]
    # the first sign is the optimizer's update-norm jump (a module's optim.update), then the
    # global gradient norm, then the loss
    run = Run("loss spike from a learning-rate spike", fault, ("spike", "*", "optim.update"),
              {("spike", "", "grad_norm"), ("spike", "", "loss"), ("spike", "*", "optim.update")},
              (fault, fault + 5), alerts, losses)
    run.event_step = loss_alerts[0] if loss_alerts else None
    return run


# -- 6. shadow error from a bf16 accumulation -------------------------------------------------------
class RunningMean(nn.Module):
    """Streaming running mean of a segment: a running total carried over from PREFIX earlier
    chunks (here taken equal to the first one) adds each chunk of the segment, and the
    segment's mean is recovered as gamma * (total - total at segment start) / count. The total
    is accumulated in `acc` - fp32, or (the fault: a refactor that dropped the upcast) the
    input's own dtype, bf16 under autocast, where a chunk ~1/500 of the total is below half an
    ulp and the subtraction cancels what is left. The fp32 shadow, fed fp32 inputs, accumulates
    in fp32 either way: it sees exactly the precision the refactor lost."""

    CHUNK, PREFIX = 2, 512

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.upcast = True

    def forward(self, x):
        b, t, d = x.shape
        c = x.view(b, t // self.CHUNK, self.CHUNK, d).sum(2)       # chunk totals
        acc = torch.float32 if self.upcast else x.dtype
        start = c[:, 0].to(acc) * self.PREFIX
        carry, outs = start, []
        for i in range(c.shape[1]):
            carry = carry + c[:, i].to(acc)
            outs.append(carry - start)
        n = torch.arange(1, c.shape[1] + 1, device=x.device).view(1, -1, 1) * self.CHUNK
        return (torch.stack(outs, 1) / n).to(x.dtype) * self.gamma


class SeqNet(nn.Module):
    def __init__(self, d_in=8, d=32):
        super().__init__()
        self.inp, self.pool, self.out = nn.Linear(d_in, d), RunningMean(d), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.pool(F.relu(self.inp(x))))[:, -1, 0]


def shadow_bf16_accumulation(run_dir, steps=24, fault=12, seq=128) -> Run:
    """bf16 autocast; from step `fault` the running mean of `pool` accumulates in bf16. Its
    fp32 shadow sees the precision loss in that module only."""
    torch.manual_seed(0)
    model = SeqNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_at(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, seq, 8, generator=g)
        return x, x[:, :, 0].mean(1)

    def refactor(step):
        model.pool.upcast = step < fault
    cfg = config(every=1, shadow_every=1)
    alerts, losses = train(model, opt, cfg, run_dir, steps, batch_at, before=refactor,
                           autocast=torch.bfloat16)
    return Run("shadow error from a bf16 accumulation", fault, ("shadow", "pool", "output"),
               {("shadow", "pool", "output")}, (fault, fault), alerts, losses)


# -- 7. attention-logit growth in a small transformer at a high learning rate -------------------
class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.scores = sw.LogitsTap("attention")     # q.k/sqrt(d_head), before the causal mask

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        s = self.scores(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=32, heads=2, layers=2, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers))
        self.attn = nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                 for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.ln[2 * i](x))
            x = x + mlp(self.ln[2 * i + 1](x))
        return self.head(self.ln_f(x))


def lm_data(vocab=32, seq=16, batch=16, seed=1):
    """A learnable synthetic language: next = (3 * prev + 1) mod vocab, 10% noise tokens."""
    def batch_at(step):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [start]
        for _ in range(seq):
            seqs.append((3 * seqs[-1] + 1) % vocab)
        s = torch.cat(seqs, 1)
        noise = torch.rand(s.shape, generator=g) < 0.1
        s = torch.where(noise, torch.randint(0, vocab, s.shape, generator=g), s)
        return s[:, :-1], s[:, 1:]
    return batch_at


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def attention_logit_growth(run_dir, steps=100, fault=20) -> Run:
    """A 1-block transformer; from step `fault` the learning rate ramps geometrically from 1e-3
    to 0.3 over 60 steps (too high for a model without qk-layernorm). The attention logits grow
    (Wortsman et al. 2023) long before the loss diverges."""
    torch.manual_seed(0)
    model = TinyLM(layers=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def ramp(step):
        f = min(1.0, max(0.0, (step - fault) / 60))
        for g in opt.param_groups:
            g["lr"] = 1e-3 * 300.0 ** f
    cfg = config(roles=("output", "grad", "loss"))
    alerts, losses = train(model, opt, cfg, run_dir, steps, lm_data(), loss_fn=lm_loss,
                           before=ramp, stop_when=lambda s, l: not math.isfinite(l))
    diverged = [a.step for a in alerts if a.tensor == "loss" and a.severity.value != "info"]
    end = diverged[0] - 1 if diverged else steps
    run = Run("attention-logit growth at a high learning rate", fault,
              ("spike", "attn.0.scores", "attn_logits"),
              {("spike", "attn.0.scores", "attn_logits"), ("spike", "", "grad_norm"),
               ("spike", "", "loss"), ("spike", "*", "grad")}, (fault, end), alerts, losses)
    run.event_step = diverged[0] if diverged else None
    return run


# -- 8. a clean run -------------------------------------------------------------------------------
def clean_run(run_dir, steps=500) -> Run:
    """The transformer at a sane learning rate with warm-up and cosine decay, bf16 autocast,
    every detector on: shadows every 10 sampled steps, attention and output logits, outputs
    judged as E4M3. No warning or critical alert may fire."""
    torch.manual_seed(0)
    model = TinyLM(layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def schedule(step):
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = 3e-3 * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
    cfg = config(shadow_every=10, output_logits=("head",), formats={"output": "e4m3"})
    alerts, losses = train(model, opt, cfg, run_dir, steps, lm_data(), loss_fn=lm_loss,
                           before=schedule, autocast=torch.bfloat16)
    return Run("clean run (500 steps)", -1, None, set(), (0, -1), alerts, losses)
