"""What capture needs from the run it watches, handed over explicitly (the Monitor builds it):
capture/ reads the model, the optimizer and a few of the Monitor's answers through this, never
the Monitor itself."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn


@dataclass(frozen=True)
class CaptureContext:
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    config: Any                      # the run's stabilitywatch.Config
    run_dir: Path
    rank: int
    world_size: int
    modules: tuple[str, ...]         # names of the watched modules
    model_factory: Optional[str]     # import paths recorded for replay
    step_fn: Optional[str]
    escalated: Callable[[int], bool]     # the step lay in an escalation window (Schedule)
    # the guard skips flagged steps and holds (latches) until released: a skipped step's
    # start-of-step state is the current state (guard.py)
    guard_holds: Callable[[], bool] = lambda: False
    hold_limit: int = 0              # steps after which the guard lets go by itself
