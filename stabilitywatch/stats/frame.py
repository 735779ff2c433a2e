"""What one step's statistics look like once on the host: a `StatsFrame`, and the `Phase` of
each row (the order of roles inside a step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .derive import DerivedRow, derive_table
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
    _derived: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _table(self) -> tuple:
        if self._derived is None:  # all rows at once: cheaper than one row at a time
            self._derived = derive_table(self.rows, self.scales)
        return self._derived

    def derived(self, i: int) -> DerivedRow:
        table, _, hists = self._table()
        return DerivedRow(table, i, hists)

    def derived_rows(self) -> list:
        """derived(i) of every row, in row order."""
        table, _, hists = self._table()
        return [DerivedRow(table, i, hists) for i in range(len(self.keys))]

    def column(self, stat: str) -> list:
        """One derived value of every row, in row order (a shared list: do not modify)."""
        if not self.keys:
            return []
        return self._table()[0][stat]

    def array(self, stat: str) -> np.ndarray:
        """column(stat) as a float64 array (shared: do not modify)."""
        arrays = self._table()[1]
        if arrays is None:
            return np.asarray(self.column(stat), dtype=np.float64)
        return arrays[stat]

    def memo(self, name: str, build: Callable[["StatsFrame"], Any]) -> Any:
        """build(self), once per frame: what several stages read (the update ratios...)."""
        try:
            return self._memo[name]
        except KeyError:
            out = self._memo[name] = build(self)
            return out

    @property
    def row_set(self) -> "RowSet":
        """The frame's keys as a hashable value (hashed once): the key of what is worked out
        from the keys alone (`PerRowSet`)."""
        rs = self._memo.get("row_set")
        if rs is None:
            rs = self._memo["row_set"] = RowSet(self.keys)
        return rs

    def index(self, module: str, role: str) -> Optional[int]:
        try:
            return self.keys.index((module, role))
        except ValueError:
            return None


class RowSet:
    """A frame's keys, hashable; frames of one schedule share the same keys."""

    __slots__ = ("keys", "_hash")

    def __init__(self, keys: list):
        self.keys = tuple(keys)
        self._hash = hash(self.keys)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, RowSet) and self._hash == other._hash and self.keys == other.keys


class PerRowSet:
    """What a detector (or the records) works out from a frame's keys alone, once per row set:
    row indices by role, a lookup per (module, role), per-row state slots. `build(keys)` gives
    it; the last `size` row sets are kept."""

    def __init__(self, build: Callable[[tuple], Any], size: int = 8):
        self._build = build
        self._size = size
        self._made: dict = {}

    def __call__(self, frame: StatsFrame) -> Any:
        rs = frame.row_set
        got = self._made.get(rs)
        if got is None:
            if len(self._made) >= self._size:
                self._made.pop(next(iter(self._made)))
            got = self._made[rs] = self._build(rs.keys)
        return got
