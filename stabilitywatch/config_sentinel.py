"""The guard's sub-config (`Config.guard`; README "Every step: the sentinel, escalation and the
guard"). The sentinel itself is switched by `Config.sentinel`.

It imports nothing from the package but config_base (config.py imports it)."""
from __future__ import annotations

from dataclasses import dataclass

from .config_base import check_bool, did_you_mean

ON_NONFINITE = ("warn", "skip")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What happens to a step whose gradients hold NaN/Inf (stabilitywatch/guard.py)."""
    on_nonfinite: str = "warn"
    """"warn": alert only. "skip": a step whose gradients hold NaN/Inf is skipped on the device
    (fused torch.optim optimizers; others: one host check per step); needs `Config.sentinel`."""
    rerun_skipped: bool = False
    """With on_nonfinite="skip" and watch(step_fn=...): a skipped step is run again in place
    (its forward and backward, every role read, no optimizer step) to name the forward module
    where the values first went bad. Costs one host wait per step (stabilitywatch/inplace.py)."""

    def __post_init__(self) -> None:
        v = getattr(self.on_nonfinite, "value", self.on_nonfinite)
        if not isinstance(v, str) or v not in ON_NONFINITE:
            raise ValueError(f"Config.guard.on_nonfinite must be one of {ON_NONFINITE}, got "
                             f"{self.on_nonfinite!r}{did_you_mean(str(v), ON_NONFINITE)}")
        object.__setattr__(self, "on_nonfinite", v)
        check_bool(self.rerun_skipped, "guard.rerun_skipped")
        if self.rerun_skipped and v != "skip":
            raise ValueError("Config.guard.rerun_skipped=True needs Config.guard.on_nonfinite="
                             "'skip' (only a skipped step's weights are still those of its start)")
