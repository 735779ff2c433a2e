"""Checks of the dashboard fields of SinkConfig (W&B and TensorBoard sinks)."""
from __future__ import annotations

import fnmatch

WANDB_RUN_MODES = ("auto", "attach", "own")
DEFAULT = "default"
SHADOW_STATS = ("rel_l2", "sqnr_db", "max_abs_err", "cosine", "max_ulp", "mean_ulp")


def stat_names() -> tuple[str, ...]:
    """Every statistic a stats record can carry, and the dashboards' own `nonfinite`."""
    from .stats.derive import derive
    from .stats.layout import init_row
    return tuple(derive(init_row())) + ("nonfinite",) + SHADOW_STATS


def check_dashboard_stats(v, name: str) -> tuple[str, ...]:
    """The entries as a tuple; an entry that names no statistic raises ValueError."""
    names = stat_names()
    items = (v,) if isinstance(v, str) else v
    if not isinstance(items, (tuple, list)):
        raise ValueError(f"Config.{name} must be a list of strings, got {v!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"Config.{name} must hold non-empty strings, got {item!r}")
        if item == DEFAULT:
            continue
        stat = item.split(":", 1)[1] if ":" in item else item
        if not any(fnmatch.fnmatchcase(n, stat) for n in names):
            raise ValueError(f"Config.{name}: {item!r} names no statistic; known: "
                             f"{', '.join(names)}")
    return tuple(items)
