"""Validation of the `# -- detectors` block of Config (drift, spike and shadow fields).

Kept apart from config.py so that the block's checks live next to nothing else and config.py stays
small; it imports only the small checks of config_extensions.py (config.py imports it)."""
from __future__ import annotations

import math

from .config_extensions import check_detector_entries

DETECTOR_NAMES = ("drift", "spike", "shadow")
SHADOW_DTYPES = ("fp32", "fp64")
DRIFT_STATS = ("absmax", "rms", "l2norm", "absmin_nonzero")

# field -> (minimum, maximum or None, strictly greater than minimum?)
_FLOATS = {
    "shadow_rel_warn": (0.0, None, True), "shadow_rel_critical": (0.0, None, True),
    "shadow_growth": (1.0, None, True), "shadow_growth_floor": (0.0, None, False),
    "drift_z": (0.0, None, True), "drift_min_sigma_bits": (0.0, None, True),
    "drift_cusum_k": (0.0, None, False), "drift_cusum_h": (0.0, None, True),
    "drift_warn_bits": (0.0, None, True), "drift_forecast_confidence": (0.5, 1.0, True),
    "drift_min_bits": (0.0, None, False), "drift_forecast_max_bits": (0.0, None, True),
    "drift_forecast_min_tau": (-1.0, 1.0, False),
    "spike_z": (0.0, None, True), "spike_loss_rel": (0.0, None, True),
    "spike_grad_bits": (0.0, None, True), "spike_layer_grad_bits": (0.0, None, True),
    "spike_attn_logit_max": (0.0, None, True),
    "spike_attn_growth_bits": (0.0, None, True), "spike_attn_floor": (0.0, None, False),
    "spike_logz_drift": (0.0, None, True),
}
_MAY_BE_INF = ("drift_warn_bits",)
_INTS = {"drift_window": 3, "drift_min_history": 2, "drift_forecast_points": 3,
         "drift_forecast_horizon": 1, "spike_window": 3, "spike_min_history": 2,
         "shadow_baseline": 1}


def _as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def validate_detector_fields(cfg, set_) -> None:
    """Normalise and check the detector fields of a Config; raise ValueError naming the field."""
    for name in ("detectors", "shadow_modules", "drift_stats", "drift_exclude_roles", "attn_logits",
                 "output_logits"):
        set_(name, _as_tuple(getattr(cfg, name)))
        for item in getattr(cfg, name):
            if not isinstance(item, str) and name != "detectors":
                raise ValueError(f"Config.{name} must hold strings, got {item!r}")
    check_detector_entries(cfg.detectors, DETECTOR_NAMES)
    for s in cfg.drift_stats:
        if s not in DRIFT_STATS:
            raise ValueError(f"Config.drift_stats: {s!r} is not one of {DRIFT_STATS}")
    if cfg.shadow_dtype not in SHADOW_DTYPES:
        raise ValueError(f"Config.shadow_dtype must be one of {SHADOW_DTYPES}, "
                         f"got {cfg.shadow_dtype!r}")
    if not isinstance(cfg.shadow_model, bool):
        raise ValueError(f"Config.shadow_model must be a bool, got {cfg.shadow_model!r}")
    for name, lo in _INTS.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"Config.{name} must be an integer >= {lo}, got {v!r}")
    for name, (lo, hi, strict) in _FLOATS.items():
        v = getattr(cfg, name)
        ok = (not isinstance(v, bool) and isinstance(v, (int, float))
              and (math.isfinite(v) or (name in _MAY_BE_INF and v == math.inf)))
        ok = ok and (v > lo if strict else v >= lo) and (hi is None or v <= hi)
        if not ok:
            rng = f"{'>' if strict else '>='} {lo:g}" + (f" and <= {hi:g}" if hi else "")
            raise ValueError(f"Config.{name} must be a finite number {rng}, got {v!r}")
        set_(name, float(v))
    if cfg.shadow_rel_warn > cfg.shadow_rel_critical:
        raise ValueError(f"Config.shadow_rel_warn ({cfg.shadow_rel_warn!r}) must not exceed "
                         f"Config.shadow_rel_critical ({cfg.shadow_rel_critical!r})")
    for prefix in ("drift", "spike"):
        hist, win = getattr(cfg, f"{prefix}_min_history"), getattr(cfg, f"{prefix}_window")
        if hist > win:
            raise ValueError(f"Config.{prefix}_min_history ({hist}) must not exceed "
                             f"Config.{prefix}_window ({win})")
