"""The capture sub-config (`Config.capture`; README "Post-mortem: capture and replay"); the
trigger grammar and the enums live in capture/policy.py."""
from __future__ import annotations

from dataclasses import dataclass

from .capture import policy as _policy
from .capture.policy import Retention, SnapshotPolicy, SnapshotTarget
from .config_base import check_enum, check_int


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """Which alerts write a capture bundle, when start-of-step state is kept for one, and how
    many bundles are kept. `Config(capture=["critical"])` is short for
    `Config(capture=CaptureConfig(triggers=("critical",)))`; `capture=()` turns capture off."""
    triggers: tuple[str, ...] = ("critical",)
    """Alerts that write a capture bundle of their step: "SEVERITY" (any detector at or above
    it), "DETECTOR" (any severity) or "DETECTOR:SEVERITY". () turns capture and snapshots off."""
    dir: str = "captures"
    """Where bundles go: relative to run_dir, or an absolute path."""
    max: int = 8
    """At most this many bundles in `dir`."""
    max_bytes: int = 4 * 1024**3
    """At most this many bytes of bundles in `dir`."""
    retention: Retention = Retention.KEEP_FIRST
    """At a limit: "keep_first" skips later captures (the first anomaly is the origin; later ones
    are mostly its consequences), "keep_last" deletes the oldest bundles to make room."""
    snapshot: SnapshotPolicy = SnapshotPolicy.AUTO
    """What is kept for bundles: "auto" (each step's batch and RNG states; the weights and
    optimizer state only when the guard skipped the step, copied once for its bundle), "sampled"
    / "every" (also a start-of-step copy of all weights and optimizer state on sampled / every
    steps), "off" (no bundles)."""
    snapshot_to: SnapshotTarget = SnapshotTarget.AUTO
    """Snapshot memory: "device" (a device copy: fast, costs device memory), "host" (pinned host
    memory, a device-to-host copy), "auto" (device while the ring takes <= 1% of it, else host)."""
    ring: int = 2
    """Snapshots held at once: a step's state is kept until its statistics are read (one step
    later on CUDA), so 2 suffice unless the GPU runs more than a step behind the host."""

    def __post_init__(self) -> None:
        cap = self.triggers
        cap = (cap,) if isinstance(cap, str) else cap
        if not isinstance(cap, (tuple, list)):
            raise ValueError(f"Config.capture.triggers must be a list of trigger strings, "
                             f"got {cap!r}")
        _policy.triggers(cap)
        object.__setattr__(self, "triggers", tuple(cap))
        if not isinstance(self.dir, str) or not self.dir.strip():
            raise ValueError(f"Config.capture.dir must be a non-empty path string, "
                             f"got {self.dir!r}")
        for name in ("max", "max_bytes", "ring"):
            check_int(getattr(self, name), f"capture.{name}", 1)
        for name, kind in (("snapshot", SnapshotPolicy), ("snapshot_to", SnapshotTarget),
                           ("retention", Retention)):
            object.__setattr__(self, name, check_enum(kind, getattr(self, name),
                                                      f"capture.{name}"))
