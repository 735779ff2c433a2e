"""NaN/Inf anywhere: one critical alert naming where they first appear in execution order."""
from __future__ import annotations

from ..alert import Alert, Severity
from ..stats.buffer import Phase, StatsFrame
from ..stats.layout import Stat
from .base import Detector


def _counts(row) -> tuple[float, float]:
    return float(row[Stat.NAN]), float(row[Stat.POSINF] + row[Stat.NEGINF])


def _where(module: str) -> str:
    return module or "<model>"


class NonFiniteDetector(Detector):
    """Critical on the step where non-finite values appear, naming the first tensor in execution
    order (batch, weights, forward, loss, backward, gradients, optimizer state) that holds them:
    every tensor read before it was finite, so its inputs were. While they persist, one warning
    every `remind_every` steps instead of a critical alert each step."""

    name = "nonfinite"

    def __init__(self, remind_every: int = 50):
        self.remind_every = remind_every
        self._episode_start: int | None = None
        self._last_reminder = 0

    def check(self, frame: StatsFrame) -> list[Alert]:
        # shadow.* rows are measurements of a replica, not tensors of the training step
        bad = [i for i in range(len(frame.keys)) if sum(_counts(frame.rows[i])) > 0
               and not frame.keys[i][1].startswith("shadow.")]
        if not bad:
            self._episode_start = None
            return []
        first = bad[0]
        module, role = frame.keys[first]
        nan, inf = _counts(frame.rows[first])
        numel = float(frame.rows[first][Stat.NUMEL])
        stat, value = ("nan", nan) if nan >= inf else ("inf", inf)
        later = [f"{_where(m)}:{r}" for m, r in (frame.keys[i] for i in bad[1:6])]
        spread = (f"; then in {len(bad) - 1} later tensor(s): {', '.join(later)}"
                  + (", ..." if len(bad) > 6 else "")) if len(bad) > 1 else ""
        origin = self._origin_text(frame, first, module, role)
        if self._episode_start is None:
            self._episode_start = self._last_reminder = frame.step
            msg = (f"{int(nan)} NaN and {int(inf)} Inf of {int(numel)} values first appear in "
                   f"{origin}{spread}")
            return [Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                          module=module, tensor=role, stat=stat, value=value, threshold=0.0,
                          message=msg, rank=frame.rank)]
        if frame.step - self._last_reminder >= self.remind_every:
            self._last_reminder = frame.step
            msg = (f"non-finite values persist since step {self._episode_start} "
                   f"({len(bad)} tensors affected; first in execution order: {origin})")
            return [Alert(step=frame.step, detector=self.name, severity=Severity.WARNING,
                          module=module, tensor=role, stat=stat, value=value, threshold=0.0,
                          message=msg, rank=frame.rank)]
        return []

    @staticmethod
    def _origin_text(frame: StatsFrame, i: int, module: str, role: str) -> str:
        phase = frame.phases[i]
        if phase == Phase.BATCH:
            return "the batch (before the model ran)"
        if role == "input":
            return f"the input of {_where(module)} (produced outside the watched modules)"
        if phase == Phase.WEIGHT:
            return f"parameter {role} of {_where(module)} (before this step's forward)"
        if role == "loss":
            return "the loss (every watched forward output was finite)"
        return f"{_where(module)} {role} (every tensor read before it was finite)"
