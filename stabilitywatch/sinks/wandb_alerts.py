"""Which alerts become `wandb.alert` calls (notifications), and with what text.

W&B notifies at a handful of alerts a minute at most; a run in trouble raises dozens in one
step. So the alerts of one step go out as one `wandb.alert` (criticals first), and each
severity has a budget of its own: criticals always go out, warnings and infos are limited per
minute separately, so infos never use up the warnings' budget. A warning held back by its limit
rides along in the next alert that goes out (or in a last one at close): every warning and
critical reaches `wandb.alert`. Held-back infos are only counted; every alert is in the table.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..alert import Alert, Severity

PER_MINUTE = {Severity.WARNING: 4.0, Severity.INFO: 1.0}
MAX_LINES = 60
LEVEL = {Severity.INFO: "INFO", Severity.WARNING: "WARN", Severity.CRITICAL: "ERROR"}
TITLE = "stabilitywatch"


@dataclass
class Message:
    title: str
    text: str
    level: str                     # wandb.AlertLevel member name


class AlertPlan:
    def __init__(self, per_minute: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.per_minute = {Severity(k): float(v) for k, v in (per_minute or PER_MINUTE).items()}
        self.clock = clock
        self._sent: dict[Severity, collections.deque] = collections.defaultdict(collections.deque)
        self._batch: list[Alert] = []
        self._carry: list[Alert] = []   # warnings held back, not yet in any message
        self._held_info = 0

    def add(self, alert: Alert) -> list[Message]:
        """Take one alert; returns the messages due now (the previous step's, if it ended)."""
        out = self.close_batch() if self._batch and self._batch[-1].step != alert.step else []
        self._batch.append(alert)
        return out

    def close_batch(self) -> list[Message]:
        batch, self._batch = self._batch, []
        if not batch:
            return []
        worst = max((Severity(a.severity) for a in batch), key=lambda s: s.rank)
        if worst is not Severity.CRITICAL and not self._may_send(worst):
            self._carry += [a for a in batch if Severity(a.severity) is not Severity.INFO]
            self._held_info += sum(Severity(a.severity) is Severity.INFO for a in batch)
            return []
        return [self._message(batch, worst)]

    def final(self) -> list[Message]:
        """At close: the open batch, then whatever was held back, whatever the limits say."""
        out = self.close_batch()
        if self._carry or self._held_info:
            worst = max((Severity(a.severity) for a in self._carry), key=lambda s: s.rank,
                        default=Severity.INFO)
            out.append(self._message([], worst))
        return out

    def _may_send(self, sev: Severity) -> bool:
        """Sliding one-minute window per severity."""
        limit = self.per_minute.get(sev)
        if limit is None:
            return True
        sent, now = self._sent[sev], self.clock()
        while sent and now - sent[0] >= 60.0:
            sent.popleft()
        if len(sent) >= limit:
            return False
        sent.append(now)
        return True

    def _message(self, batch: list[Alert], worst: Severity) -> Message:
        order = sorted(batch, key=lambda a: -Severity(a.severity).rank)   # stable: criticals first
        carried, self._carry = self._carry, []
        held_info, self._held_info = self._held_info, 0
        lines = [a.line() for a in order]
        if carried:
            lines.append(f"Held back earlier by the limit of "
                         f"{self.per_minute[Severity.WARNING]:g} warning alert(s) a minute:")
            lines += [a.line() for a in carried]
        if len(lines) > MAX_LINES:
            lines = lines[:MAX_LINES] + [f"... and {len(lines) - MAX_LINES} more line(s)"]
        if held_info:
            lines.append(f"({held_info} info alert(s) held back by the limit of "
                         f"{self.per_minute[Severity.INFO]:g} a minute)")
        lines.append("Every alert is in the run's sw.alerts/table.")
        if batch:
            top = order[0]
            more = f" (+{len(batch) - 1})" if len(batch) > 1 else ""
            title = (f"{TITLE}: step {top.step} {top.detector} in "
                     f"{top.module or 'model'}{more}")
        else:
            title = f"{TITLE}: {len(carried)} held-back alert(s)"
        return Message(title=title[:63], text="\n".join(lines), level=LEVEL[worst])
