"""Which steps are sampled for which role, decided on the host from integers only.

Escalation: a trigger (a tripped sentinel, a warning-or-worse alert) read from a frame switches
the next `escalate_steps` steps to every role of `Config.roles` at every step (role_every and
`every` set aside; Role.INPUT only when configured: a module's input is the output of the
module before it). Frames arrive a step late, so the window opens at
the first step the host begins after the trigger. While a window is open, triggers do not
extend it: a fault that persists gets windows of full sampling, not full sampling forever.

Outside the windows the cadences (`every`, role_every) are stretched by one whole factor, the
cost budget's (pacing.py): 1 until the run's own step times say otherwise.
"""
from __future__ import annotations

from typing import Optional

from .config import Config, Role


class Schedule:
    def __init__(self, config: Config):
        self.every = config.every
        self.warmup = config.warmup
        self.role_every = {Role(k): v for k, v in config.role_every.items()}
        self.roles = frozenset(config.roles)
        self.escalate_steps = config.escalate_steps
        self._asked: Optional[str] = None          # a trigger waiting for the next step begun
        self._window: Optional[tuple[int, int]] = None   # [first, end) of the open window
        self.windows: list[tuple[int, int, str]] = []    # (first, end, why), for records
        self._force = False
        self.pacer = None   # pacing.Pacer: its factor stretches `every` and role_every alike

    def escalate(self, why: str) -> bool:
        """Ask for full sampling from the next step begun on. False when escalation is off or a
        window is open (or already asked for)."""
        if self.escalate_steps <= 0 or self._asked is not None or self._window is not None:
            return False
        self._asked = why
        return True

    def force_next(self) -> None:
        """Every configured role at the next step begun only (a re-run of a skipped step)."""
        self._force = True

    def escalated(self, step: int) -> bool:
        """True when `step` lay (or lies) in an escalation window."""
        return any(lo <= step < hi for lo, hi, _ in self.windows[-4:])

    def roles_at(self, step: int) -> frozenset[Role]:
        """The roles read at this step (called once per step begun, in order). The loss (one
        element) is read every step; every configured role inside an escalation window."""
        if self._force:
            self._force = False
            return self.roles | {Role.LOSS}
        if self._window is not None and not self._window[0] <= step < self._window[1]:
            self._window = None
        if self._asked is not None and self._window is None:
            self._window = (step, step + self.escalate_steps)
            self.windows.append((step, step + self.escalate_steps, self._asked))
            self._asked = None
        if self._window is not None:
            return self.roles | {Role.LOSS}
        on = set()
        factor = self.pacer.factor if self.pacer is not None else 1
        for role in self.roles:
            every = self.role_every.get(role, self.every) * factor
            if role is Role.LOSS or step < self.warmup or step % every == 0:
                on.add(role)
        return frozenset(on)
