"""Modules that report tensors of their own (FP8 casts, scales, amax histories) to the monitor:
any module with `stabilitywatch_attach(observe)` / `stabilitywatch_detach()` methods, e.g.
stabilitywatch.integrations.fp8.Fp8Linear."""
from __future__ import annotations

import functools
from typing import Callable

import torch.nn as nn


def attach_observers(model: nn.Module, observe: Callable) -> list[nn.Module]:
    attached = []
    for name, mod in model.named_modules():
        if callable(getattr(mod, "stabilitywatch_attach", None)):
            mod.stabilitywatch_attach(functools.partial(observe, module=name))
            attached.append(mod)
    return attached


def detach_observers(modules: list[nn.Module]) -> None:
    for mod in modules:
        detach = getattr(mod, "stabilitywatch_detach", None)
        if callable(detach):
            detach()
