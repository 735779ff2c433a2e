"""What one step's statistics look like once on the host: a `StatsFrame`, and the `Phase` of
each row (the order of roles inside a step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .derive import derive_many
from .sentinel import SentinelFrame


class Phase:
    """Execution order of roles inside a step, for 'where did it first appear'."""
    BATCH = 0
    WEIGHT = 1
    FORWARD = 2
    LOSS = 3
    BACKWARD = 4
    GRAD = 5
    OPTIM = 6


@dataclass
class StatsFrame:
    """The statistics of one step: rows in execution order (phase, then first touch)."""
    step: int
    keys: list[tuple[str, str]]      # (module, role)
    rows: np.ndarray                 # [len(keys), N_STATS] float64
    scales: list[float]
    phases: list[int]
    rank: int = 0
    world_size: int = 1
    # every parameter gradient's non-finite count, absmax and sum of squares, in backward
    # order (stats/sentinel.py); None when no gradient was read this step
    sentinel: Optional[SentinelFrame] = None
    _derived: dict = field(default_factory=dict, repr=False)

    def derived(self, i: int) -> dict[str, float]:
        if not self._derived:  # all rows at once: cheaper than one row at a time
            self._derived.update(enumerate(derive_many(self.rows, self.scales)))
        return self._derived[i]

    def column(self, stat: str) -> list:
        """One derived value of every row, in row order (a shared list: do not modify)."""
        if not self.keys:
            return []
        return self.derived(0).column(stat)

    def index(self, module: str, role: str) -> Optional[int]:
        try:
            return self.keys.index((module, role))
        except ValueError:
            return None
