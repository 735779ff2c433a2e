"""Alerts: what a detector says about one (step, module, tensor role, statistic)."""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SCHEMA_VERSION = 1

# Every value an alert's `detector` can take: the one list that Config.capture's triggers are
# checked against. A new detector adds its name here.
DETECTORS = ("nonfinite", "overflow", "underflow", "drift", "spike", "shadow", "divergence",
             "physics")


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "critical": 2}[self.value]


@dataclass(frozen=True)
class Alert:
    step: int
    detector: str
    severity: Severity
    module: str            # qualified name from model.named_modules(); "" for whole-model signals
    tensor: str            # role: output, input, grad_output, weight, grad, optim.<state>, loss...
    stat: str
    value: float
    threshold: float
    message: str
    rank: int = 0
    capture: Optional[str] = None
    schema: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)
    incident: Optional[str] = None   # id of the incident it belongs to (stabilitywatch/incidents)
    root: bool = False               # it names the incident's cause (written first)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["value"] = _json_float(self.value)
        d["threshold"] = _json_float(self.threshold)
        return d

    def line(self) -> str:
        where = self.module or "<model>"
        inc = (f" incident {self.incident}{'' if self.root else ' (consequence)'}"
               if self.incident else "")
        return (f"[stabilitywatch] {self.severity.value.upper()} step {self.step} rank {self.rank}"
                f"{inc} "
                f"{self.detector}: {where} {self.tensor} {self.stat}={_fmt(self.value)} "
                f"(threshold {_fmt(self.threshold)}) - {self.message}")


def _json_float(v: float):
    """JSON has no NaN/Inf: keep finite floats, write the others as strings."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
