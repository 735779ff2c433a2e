"""Validation of the `# -- frame processing` block of Config (stabilitywatch/processing.py).

It imports nothing from the package (config.py imports it)."""
from __future__ import annotations

import math

PROCESSING_MODES = ("thread", "inline")


def validate_processing_fields(cfg, set_) -> None:
    """Normalise and check the block's fields; raise ValueError naming the field."""
    v = getattr(cfg.processing, "value", cfg.processing)
    if not isinstance(v, str) or v not in PROCESSING_MODES:
        raise ValueError(f"Config.processing must be one of {PROCESSING_MODES}, "
                         f"got {cfg.processing!r}")
    set_("processing", v)
    v = cfg.processing_lag
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"Config.processing_lag must be an integer >= 0, got {v!r}")
    v = cfg.processing_timeout
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"Config.processing_timeout must be a positive number of seconds, "
                         f"got {v!r}")
