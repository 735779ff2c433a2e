"""Validation of the `# -- sentinel, escalation and guard` block of Config.

It imports nothing from the package (config.py imports it)."""
from __future__ import annotations

import math

ON_NONFINITE = ("warn", "skip")


def validate_sentinel_fields(cfg, set_) -> None:
    """Normalise and check the block's fields; raise ValueError naming the field."""
    for name in ("sentinel", "update_stats", "rerun_skipped"):
        v = getattr(cfg, name)
        if not isinstance(v, bool):
            raise ValueError(f"Config.{name} must be a bool, got {v!r}")
    for name, lo in (("escalate_steps", 0), ("update_window", 3), ("update_min_history", 2)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"Config.{name} must be an integer >= {lo}, got {v!r}")
    if cfg.update_min_history > cfg.update_window:
        raise ValueError(f"Config.update_min_history ({cfg.update_min_history}) must not exceed "
                         f"Config.update_window ({cfg.update_window})")
    v = cfg.on_nonfinite
    v = getattr(v, "value", v)
    if not isinstance(v, str) or v not in ON_NONFINITE:
        raise ValueError(f"Config.on_nonfinite must be one of {ON_NONFINITE}, "
                         f"got {cfg.on_nonfinite!r}")
    set_("on_nonfinite", v)
    v = cfg.update_spike_bits
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"Config.update_spike_bits must be a finite number > 0, got {v!r}")
    set_("update_spike_bits", float(v))
    if cfg.rerun_skipped and cfg.on_nonfinite != "skip":
        raise ValueError("Config.rerun_skipped=True needs Config.on_nonfinite='skip' (only a "
                         "skipped step's weights are still those of its start)")
    if cfg.on_nonfinite == "skip" and not cfg.sentinel:
        raise ValueError("Config.on_nonfinite='skip' needs Config.sentinel=True (the guard "
                         "decides from the sentinel)")
