"""Optimizers that trainers hand out wrapped: Accelerate's `AcceleratedOptimizer` (a
torch.optim.Optimizer subclass that never runs Optimizer.__init__, so it has no hook registry)
and Lightning's `LightningOptimizer`. The monitor's hooks go on the optimizer inside.

`sw.watch(model, optimizer)` unwraps by itself: with Accelerate, watch the prepared model and
the prepared optimizer (`model, opt = accelerator.prepare(model, opt)`)."""
from __future__ import annotations

from typing import Any

import torch

# attribute holding the real optimizer: Accelerate's AcceleratedOptimizer, Lightning's
# LightningOptimizer
_INNER = ("optimizer", "_optimizer")
_MAX_DEPTH = 8


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer inside trainer wrappers; `opt` itself when it is not wrapped."""
    for _ in range(_MAX_DEPTH):
        if opt is None or _has_hooks(opt):
            return opt
        inner = next((getattr(opt, a) for a in _INNER
                      if isinstance(getattr(opt, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is opt:
            return opt
        opt = inner
    return opt


def _has_hooks(opt: Any) -> bool:
    # a real optimizer has run Optimizer.__init__: its hook registries exist
    return (isinstance(opt, torch.optim.Optimizer)
            and hasattr(opt, "_optimizer_step_pre_hooks") and "param_groups" in vars(opt))
