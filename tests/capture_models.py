"""Tiny models and step functions for capture/replay tests, importable as
"capture_models:build" (pytest puts tests/ on sys.path; subprocess tests add it to PYTHONPATH).

Tiny: fc2's output overflows fp16 (max 65504) when its weights are scaled up; the LayerNorm after
it runs in fp32 under autocast, so computing fc2 in fp32 removes every non-finite value.

Wide: `out`'s weight scaled x1e4 makes the output gradient reaching `inp` ~1e3 per sample; the
gradient of inp's weight sums it over a batch of 64 inputs of mean 2, past fp16's max, while every
output and output gradient stays finite: only a parameter gradient overflows."""
from __future__ import annotations

import numpy as np

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.ln = nn.LayerNorm(32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.ln(self.fc2(F.gelu(self.fc1(x)))))


def build() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def step_fp16(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.autocast(device_type=batch["x"].device.type, dtype=torch.float16):
        out = model(batch["x"])
    return (out.float() - batch["y"]).square().mean()


def step_perturbed(model: nn.Module, batch: dict) -> torch.Tensor:
    """Not the recorded computation: a replay with it must not reproduce."""
    return step_fp16(model, {**batch, "x": batch["x"] * (1 + 2 ** -10)})


def step_noisy(model: nn.Module, batch: dict) -> torch.Tensor:
    """Noise from an unseeded source (OS entropy), which no restored RNG state can repeat."""
    noise = torch.from_numpy(np.random.default_rng().standard_normal(tuple(batch["x"].shape)))
    return step_fp16(model, {**batch, "x": batch["x"] + 1e-3 * noise.to(batch["x"].dtype)})


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def build_wide() -> Wide:
    torch.manual_seed(0)
    return Wide()


def step_sum_fp16(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.autocast(device_type=batch["x"].device.type, dtype=torch.float16):
        out = model(batch["x"])
    return out.float().sum()


def wide_batches(n: int, seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": 2 + 0.5 * torch.randn(64, 8, generator=g)} for _ in range(n)]


def train_wide(run_dir, steps: int = 4, fault_step: int = 2, fault: float = 1e4,
               device: str = "cpu"):
    """Train Wide with the monitor; at fault_step scale out's weight by `fault`."""
    import stabilitywatch as sw

    model = build_wide().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with sw.watch(model, opt, config=sw.Config(every=1, sinks=("jsonl",), capture={"snapshot": "sampled"}),
                  run_dir=run_dir,
                  model_factory="capture_models:build_wide",
                  step_fn="capture_models:step_sum_fp16") as mon:
        for step, batch in enumerate(wide_batches(steps)):
            batch = {k: v.to(device) for k, v in batch.items()}
            if step == fault_step:
                with torch.no_grad():
                    model.out.weight.mul_(fault)
            with mon.step(step, batch=batch):
                loss = step_sum_fp16(model, batch)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return mon, model, opt


def batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g),
             "meta": {"ids": torch.arange(16), "note": "synthetic", "scale": 1.5}}
            for _ in range(n)]


def train(run_dir, steps: int = 6, fault_step: int = 3, config=None, fault: float = 1e5,
          model_factory: str = "capture_models:build", step_fn: str = "capture_models:step_fp16",
          before_step=None, loop_step=None, during_step=None):
    """Train with the monitor; at fault_step scale fc2's weights by `fault` (stays scaled).
    `loop_step`: the step function the loop runs (default step_fp16); `during_step(mon, step,
    model)`: loop code run inside each step block."""
    import stabilitywatch as sw

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the faults are weight writes, whose steps the guard does not skip: the start-of-step
    # snapshots of the "sampled" policy give their bundles the state to replay
    config = config or sw.Config(every=1, sinks=("jsonl",), capture={"snapshot": "sampled"})
    with sw.watch(model, opt, config=config, run_dir=run_dir, model_factory=model_factory,
                  step_fn=step_fn) as mon:
        for step, batch in enumerate(batches(steps)):
            if step == fault_step:
                with torch.no_grad():
                    model.fc2.weight.mul_(fault)
            if before_step is not None:
                before_step(step, model, opt, batch)
            with mon.step(step, batch=batch):
                loss = (loop_step or step_fp16)(model, batch)
                if during_step is not None:
                    during_step(mon, step, model)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return mon, model, opt


def nan_hook_at(step_no: int, module: str, prepend: bool = True):
    """A `before_step` that registers, in the loop, a forward hook writing NaN into one value of
    `module`'s output on step `step_no`, and removes it on the next step. prepend: it runs ahead
    of the monitor's hook (the module's row shows the NaN); otherwise after it (the next
    module's row does)."""
    handles = []

    def before(step, model, opt, batch):
        while handles:
            handles.pop().remove()
        if step == step_no:
            def poison(mod, args, out):
                out = out.clone()
                out.view(-1)[0] = float("nan")
                return out
            handles.append(model.get_submodule(module).register_forward_hook(
                poison, prepend=prepend))
    return before
