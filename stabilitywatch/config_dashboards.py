"""Checks of the dashboard fields of Config (W&B and TensorBoard sinks)."""
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


def validate_dashboard_fields(cfg, set_) -> None:
    names = stat_names()
    for field in ("dashboard_stats", "wandb_stats"):
        v = getattr(cfg, field)
        items = (v,) if isinstance(v, str) else v
        if not isinstance(items, (tuple, list)):
            raise ValueError(f"Config.{field} must be a list of strings, got {v!r}")
        for item in items:
            if not isinstance(item, str) or not item:
                raise ValueError(f"Config.{field} must hold non-empty strings, got {item!r}")
            if item == DEFAULT:
                if field == "wandb_stats":
                    raise ValueError('Config.wandb_stats: "default" belongs in dashboard_stats')
                continue
            stat = item.split(":", 1)[1] if ":" in item else item
            if not any(fnmatch.fnmatchcase(n, stat) for n in names):
                raise ValueError(f"Config.{field}: {item!r} names no statistic; known: "
                                 f"{', '.join(names)}")
        set_(field, tuple(items))
    if not isinstance(cfg.dashboard_histograms, bool):
        raise ValueError(f"Config.dashboard_histograms must be True or False, "
                         f"got {cfg.dashboard_histograms!r}")
    if cfg.wandb_run not in WANDB_RUN_MODES:
        raise ValueError(f"Config.wandb_run must be one of {WANDB_RUN_MODES}, "
                         f"got {cfg.wandb_run!r}")
