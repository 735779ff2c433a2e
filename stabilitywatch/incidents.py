"""Incidents: the alerts of one step that share a cause, with the alert that names the cause first.

The detectors judge each (module, role) on its own; one fault moves many of them at once (a bad
weight moves every output after it, the loss and every gradient). Here the alerts of a step
become one incident:
- its root is the earliest departing tensor in dataflow order: the frame's rows are in execution
  order (batch, weights, forward outputs, loss, output gradients in backward order, parameter
  gradients, optimizer state), so a weight comes before the outputs it feeds; alerts about
  whole-model signals sit where they are computed (the loss after the forward, the global
  gradient norm after the gradients). Candidates are the alerts of warning or worse and change
  points of at least `incidents.warn_bits`; the nonfinite detector's origin (the first non-finite
  tensor in execution order) is the same rule for NaN/Inf;
- a change point that is the root is at least a warning, a critical one past
  `incidents.critical_bits`; the incident's severity is its root's, raised to the highest
  severity among its consequences (so a filter on severity never drops the root of an incident
  it would keep a consequence of);
- the root is written first (alerts.jsonl file order) and its message names the consequences;
- alerts of the steps after it, while an escalation window (`Config.escalate_steps`, where the
  schedule has one) is open, join it as consequences unless they are more severe than it or
  hold a bad write (`physics`: nothing in training causes one);
- change points that belong to no incident are statistics (records `drift.<role>` in
  stats.jsonl), not alerts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .alert import Alert, Severity
from .stats.buffer import Phase

_INF = math.inf
CAUSES = ("physics",)   # detectors whose findings always open an incident of their own
_BY_RANK = {s.rank: s for s in Severity}


def is_change_point(a: Alert) -> bool:
    """A departure of a statistic from its own history (drift change points, per-layer gradient
    norm jumps): evidence for an incident, not a finding of its own."""
    return bool(a.extra.get("change_point"))


def _bits(a: Alert) -> float:
    v = a.extra.get("bits")
    return abs(float(v)) if isinstance(v, (int, float)) else 0.0


def _phase_of(a: Alert) -> int:
    r = a.tensor
    if r in ("weight",) or a.detector == "physics":
        return Phase.WEIGHT
    if r == "loss":
        return Phase.LOSS
    if r.startswith("grad_output"):
        return Phase.BACKWARD
    if r == "grad_norm" or r == "grad" or r.startswith("grad."):
        return Phase.GRAD
    if r.startswith("optim."):
        return Phase.OPTIM
    return Phase.FORWARD


@dataclasses.dataclass
class _Open:
    id: str
    severity: Severity
    until: int          # last step whose alerts may join


class Incidents:
    def __init__(self, config):
        self.warn_bits = config.incidents.warn_bits
        self.crit_bits = config.incidents.critical_bits
        # the escalation window of the schedule, where there is one
        self.window = int(getattr(config, "escalate_steps", 0) or 0)
        self._open: Optional[_Open] = None
        self._count: dict[int, int] = {}

    def group(self, frame, alerts: list[Alert]) -> tuple[list[Alert], list[Alert]]:
        """(the step's alerts as incidents, roots first; change points that are statistics)."""
        if not alerts:
            return [], []
        pos = _positions(frame)
        order = sorted(range(len(alerts)), key=lambda j: (self._where(alerts[j], pos), j))
        alerts = [alerts[j] for j in order]
        findings = [a for a in alerts if not is_change_point(a)]
        op = self._open
        # a bad write is a cause by nature: no earlier incident explains it
        fresh = any(a.detector in CAUSES for a in findings)
        if op is not None and frame.step <= op.until and findings and not fresh:
            worst = max(a.severity.rank for a in alerts)
            if worst <= op.severity.rank:
                if any(a.severity.rank >= 1 for a in findings):
                    op.until = max(op.until, frame.step + self.window)
                return [dataclasses.replace(a, incident=op.id, root=False) for a in alerts], []
        if not findings:
            return [], alerts
        cands = [a for a in alerts
                 if a.severity.rank >= 1 or (is_change_point(a) and _bits(a) >= self.warn_bits)]
        root = (cands or findings)[0]
        rest = [a for a in alerts if a is not root]
        sev = root.severity.rank
        if is_change_point(root):
            b = _bits(root)
            sev = max(sev, 2 if b >= self.crit_bits else 1 if b >= self.warn_bits else 0)
        sev = max([sev] + [a.severity.rank for a in rest])
        k = self._count[frame.step] = self._count.get(frame.step, 0) + 1
        iid = f"s{frame.step}-{k}"
        if len(self._count) > 64:
            self._count = {s: n for s, n in self._count.items() if s >= frame.step - 64}
        severity = _BY_RANK[sev]
        self._open = _Open(iid, severity, frame.step + self.window) if sev >= 1 else None
        head = dataclasses.replace(root, severity=severity, incident=iid, root=True,
                                   message=root.message + _summary(root, rest, severity),
                                   extra={**root.extra, "consequences": len(rest)})
        return [head] + [dataclasses.replace(a, incident=iid, root=False) for a in rest], []

    @staticmethod
    def _where(a: Alert, pos: dict) -> tuple:
        i = pos.get((a.module, a.tensor))
        if i is not None and a.tensor != "grad_norm":
            # on one row, findings before the change points they explain (physics before drift)
            return (i[0], i[1], -a.severity.rank, is_change_point(a))
        return (_phase_of(a), _INF, -a.severity.rank, is_change_point(a))


def _positions(frame) -> dict:
    return {k: (frame.phases[i], i) for i, k in reversed(list(enumerate(frame.keys)))}


def _summary(root: Alert, rest: list[Alert], severity: Severity) -> str:
    if not rest:
        return ""
    names = []
    for a in rest:
        n = f"{a.module or '<model>'} {a.tensor}"
        if n not in names:
            names.append(n)
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raised = (f"; {severity.value} from its consequences" if severity is not root.severity
              and not is_change_point(root) else "")
    return f" [+{len(rest)} consequence{'s' if len(rest) != 1 else ''}: {shown}{raised}]"


def change_records(frame, changes: list[Alert], base: dict) -> list[dict]:
    """stats.jsonl records of the change points that are not alerts: one per (module, role),
    tensor `drift.<role>`, stats `<stat>_bits` (log2 distance from the median) and `<stat>_z`."""
    out: dict = {}
    for a in changes:
        stat = a.stat[5:] if a.stat.startswith("log2_") else a.stat
        rec = out.setdefault((a.module, a.tensor), {**base, "module": a.module,
                                                    "tensor": "drift." + a.tensor, "stats": {}})
        rec["stats"][f"{stat}_bits"] = float(a.extra.get("bits", a.value))
        z = a.extra.get("z")
        if isinstance(z, (int, float)):
            rec["stats"][f"{stat}_z"] = float(z)
    return list(out.values())


def manifest_incidents(alerts: list[Alert]) -> list[dict]:
    """The incidents of a capture's alerts: id, severity, root (module, tensor, detector, stat,
    message) and the number of consequences, roots in file order."""
    out: dict = {}
    for a in alerts:
        if a.incident is None:
            continue
        inc = out.setdefault(a.incident, {"id": a.incident, "consequences": 0})
        if a.root:
            inc.update(severity=a.severity.value, step=a.step, detector=a.detector,
                       module=a.module, tensor=a.tensor, stat=a.stat, message=a.message)
        else:
            inc["consequences"] += 1
    return list(out.values())
