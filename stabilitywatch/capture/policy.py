"""Capture settings that Config validates: which alerts trigger a capture, when start-of-step
state is kept, where it is kept, and what happens when the limits are reached.

No torch import here: config.py imports this module."""
from __future__ import annotations

import difflib
import enum
from typing import Any

from ..alert import DETECTORS

SEVERITIES = ("info", "warning", "critical")
SEV_RANK = {s: i for i, s in enumerate(SEVERITIES)}


class SnapshotPolicy(str, enum.Enum):
    """What is kept per step for a bundle (capture/state.py). Every policy but "off" keeps each
    step's batch (a reference) and RNG states, and writes a bundle for every alert that asks for
    one; they differ in the weights and optimizer state."""
    AUTO = "auto"         # no per-step copy: with the guard, a skipped step's state (held by the
    #                       guard) copied once for its bundle; without it, bundles lack the weights
    SAMPLED = "sampled"   # also a start-of-step copy of all weights and optimizer state on sampled steps
    EVERY = "every"       # also that copy on every step
    OFF = "off"           # nothing kept: bundles are not written


class SnapshotTarget(str, enum.Enum):
    """Where the snapshot ring lives."""
    AUTO = "auto"         # the parameters' device while the ring takes <= 1% of its memory, else host
    DEVICE = "device"     # same device as each tensor: one device copy, costs device memory
    HOST = "host"         # pinned host memory: no device memory, costs a device-to-host copy


class Retention(str, enum.Enum):
    """What happens when capture.max or capture.max_bytes would be exceeded."""
    KEEP_FIRST = "keep_first"  # later captures are skipped: the first anomaly is the origin
    KEEP_LAST = "keep_last"    # the oldest bundles are deleted to make room


def parse_trigger(entry: Any) -> tuple[str, int]:
    """'critical' -> ('*', 2); 'overflow' -> ('overflow', 0); 'nonfinite:warning' ->
    ('nonfinite', 1); '*:warning' -> ('*', 1). A severity means 'at or above it'. Detector
    names are those of alert.DETECTORS; an unknown name or severity raises ValueError with the
    closest match."""
    if not isinstance(entry, str) or not entry or entry.count(":") > 1:
        raise ValueError(f"Config.capture entries must be 'SEVERITY', 'DETECTOR' or "
                         f"'DETECTOR:SEVERITY' strings, got {entry!r}")
    det, colon, sev = entry.partition(":")
    if not colon:
        if det in SEV_RANK:
            return "*", SEV_RANK[det]
        if det in DETECTORS:
            return det, 0
        raise ValueError(f"Config.capture entry {entry!r} is neither a severity {SEVERITIES} nor "
                         f"a detector {DETECTORS}{_did_you_mean(det, SEVERITIES + DETECTORS)}")
    if det != "*" and det not in DETECTORS:
        raise ValueError(f"Config.capture entry {entry!r}: unknown detector {det!r}; expected "
                         f"one of {DETECTORS} or '*'{_did_you_mean(det, DETECTORS)}")
    if sev not in SEV_RANK:
        raise ValueError(f"Config.capture entry {entry!r}: severity must be one of "
                         f"{SEVERITIES}{_did_you_mean(sev, SEVERITIES)}")
    return det, SEV_RANK[sev]


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word.lower(), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def triggers(entries) -> list[tuple[str, int]]:
    return [parse_trigger(e) for e in entries]


def matches(trig: list[tuple[str, int]], detector: str, severity: str) -> bool:
    rank = SEV_RANK.get(severity, 0)
    return any((d == "*" or d == detector) and rank >= r for d, r in trig)
