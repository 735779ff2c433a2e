"""The taps beyond the statistics of watched tensors: shadow replicas and logits taps, framed
by the monitor's steps. The Monitor holds one of these; it holds no logic of its own."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..config import Config, Role
from ..shadow.runner import ShadowRunner, shadow_targets
from .logits import LogitTaps, logit_modules


class ExtraTaps:
    def __init__(self, model: nn.Module, config: Config, watched: list[tuple[str, nn.Module]],
                 record: Callable, is_on: Callable[[Role], bool]):
        self.shadow = None
        if config.shadow_every:
            self.shadow = ShadowRunner(model, config, shadow_targets(model, config, watched),
                                       record, {n for n, _ in watched})
        targets = logit_modules(model, config)
        self.logits = LogitTaps(targets, record, is_on) if targets else None

    @property
    def running(self) -> bool:
        """True while a shadow replica runs: the monitor's own taps must not read its tensors."""
        return self.shadow is not None and self.shadow.running

    def attach(self) -> None:
        try:
            for part in (self.shadow, self.logits):
                if part is not None:
                    part.attach()
        except Exception:
            self.detach()
            raise

    def detach(self) -> None:
        for part in (self.shadow, self.logits):
            if part is not None:
                part.detach()

    def begin_step(self, on: frozenset) -> None:
        if self.shadow is not None:
            self.shadow.begin_step(on)

    def end_step(self) -> None:
        if self.shadow is not None:
            self.shadow.end_step()
