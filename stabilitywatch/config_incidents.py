"""Validation of the `# -- incidents and severities` block of Config (imports nothing from the
package: config.py imports it)."""
from __future__ import annotations

import math


def _number(cfg, name: str, minimum: float, strict: bool) -> float:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not (v > minimum if strict else v >= minimum):
        raise ValueError(f"Config.{name} must be a finite number {'>' if strict else '>='} "
                         f"{minimum:g}, got {v!r}")
    return float(v)


def validate_incident_fields(cfg, set_) -> None:
    for name, lo, strict in (("incident_warn_bits", 0.0, True),
                             ("incident_critical_bits", 0.0, True),
                             ("weight_update_margin", 1.0, False)):
        set_(name, _number(cfg, name, lo, strict))
    v = cfg.spike_loss_recent
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Config.spike_loss_recent must be an integer >= 1, got {v!r}")
    if cfg.incident_warn_bits > cfg.incident_critical_bits:
        raise ValueError(f"Config.incident_warn_bits ({cfg.incident_warn_bits!r}) must not "
                         f"exceed Config.incident_critical_bits ({cfg.incident_critical_bits!r})")
