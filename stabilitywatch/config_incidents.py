"""Sub-configs of the range detectors, the weight-update detectors and the incident grouping
(`Config.range`, `Config.update`, `Config.incidents`; README "Detectors and their defaults").

It imports nothing from the package but config_base (config.py imports it)."""
from __future__ import annotations

from dataclasses import dataclass

from .config_base import check_bool, check_int, check_number, not_above


def _set(obj, name, value):
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in __post_init__


@dataclass(frozen=True, kw_only=True)
class RangeConfig:
    """The overflow and underflow detectors: fractions of a tensor outside the range of the
    format its role maps to in `Config.formats`."""
    overflow_warn: float = 0.0
    """Warning when the fraction of finite values above the format's max exceeds this."""
    overflow_critical: float = 1e-3
    """Critical when the fraction of finite values above the format's max exceeds this."""
    underflow_warn: float = 0.2
    """Warning when the fraction of nonzero finite values that round to zero exceeds this."""
    underflow_critical: float = 0.9
    """Critical when the fraction of nonzero finite values that round to zero exceeds this."""
    min_numel: int = 64
    """Overflow/underflow fractions of tensors smaller than this are not judged (noise)."""

    def __post_init__(self) -> None:
        for name in ("overflow_warn", "overflow_critical", "underflow_warn", "underflow_critical"):
            _set(self, name, check_number(getattr(self, name), f"range.{name}", 0.0, 1.0,
                                          what="a fraction"))
        for kind in ("overflow", "underflow"):
            not_above(getattr(self, f"{kind}_warn"), getattr(self, f"{kind}_critical"),
                      f"range.{kind}_warn", f"range.{kind}_critical")
        check_int(self.min_numel, "range.min_numel", 0)


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """The optimizer update ||dW|| / ||W|| per module (the `update` detector) and the physics
    check of weights against the most their optimizer could move them."""
    stats: bool = True
    """On sampled steps that read weights, the optimizer update ||dW|| / ||W|| per module
    (role `update`, stat `update_ratio`), judged by the `update` detector."""
    spike_bits: float = 3.0
    """Warning when log2(update ratio) is this many bits above its median over the last
    `window` samples (and above the median's noise)."""
    window: int = 50
    """Samples of a module's update ratio in the median that `spike_bits` is measured from."""
    min_history: int = 8
    """Samples of a module's update ratio before it is judged."""
    weight_margin: float = 2.0
    """Physics: a weight's max or min that moved more than this times the most its optimizer
    could move one element since the previous read (Adam/AdamW: a bound from lr and the betas;
    SGD: lr x gradient, momentum) is critical: a bad write or silent data corruption."""

    def __post_init__(self) -> None:
        check_bool(self.stats, "update.stats")
        _set(self, "spike_bits", check_number(self.spike_bits, "update.spike_bits", 0.0,
                                              strict=True))
        check_int(self.window, "update.window", 3)
        check_int(self.min_history, "update.min_history", 2)
        not_above(self.min_history, self.window, "update.min_history", "update.window")
        _set(self, "weight_margin", check_number(self.weight_margin, "update.weight_margin", 1.0))


@dataclass(frozen=True, kw_only=True)
class IncidentConfig:
    """How findings become alerts: incident grouping, severities of change points, and the
    cooldown between repeats."""
    warn_bits: float = 4.0
    """A change point of at least this many bits (x16) from its median may be the root of an
    incident, and is then at least a warning (smaller ones are statistics)."""
    critical_bits: float = 10.0
    """A change point of at least this many bits (x1024) that is the root of an incident makes
    it critical."""
    cooldown: int = 50
    """Steps before the same (detector, module, tensor, stat) may alert again at the same
    severity (a higher severity always goes through)."""

    def __post_init__(self) -> None:
        for name in ("warn_bits", "critical_bits"):
            _set(self, name, check_number(getattr(self, name), f"incidents.{name}", 0.0,
                                          strict=True))
        not_above(self.warn_bits, self.critical_bits, "incidents.warn_bits",
                  "incidents.critical_bits")
        check_int(self.cooldown, "incidents.cooldown", 0)
