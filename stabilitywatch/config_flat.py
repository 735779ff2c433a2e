"""The flat spellings of Config fields (`drift_window`) and the nested fields they now name
(`drift.window`): the one table of renames, and the path that turns flat keyword arguments and
flat config-file keys into sub-config values with a DeprecationWarning.

It imports nothing from the package but config_base (config.py imports it)."""
from __future__ import annotations

import sys
import warnings
from typing import Any, Mapping

from .config_base import UnknownFieldError, did_you_mean

# flat name -> "group.field". A flat name whose value needs translating is in _TRANSLATE.
FLAT_NAMES: dict[str, str] = {
    **{f"drift_{n}": f"drift.{n}" for n in (
        "stats", "exclude_roles", "window", "min_history", "min_sigma_bits", "z", "cusum_k",
        "cusum_h", "min_bits", "warn_bits", "forecast_points", "forecast_horizon",
        "forecast_max_bits", "forecast_min_tau", "forecast_confidence")},
    **{f"spike_{n}": f"spike.{n}" for n in (
        "window", "min_history", "z", "loss_rel", "grad_bits", "layer_grad_bits", "loss_recent",
        "attn_logit_max", "attn_growth_bits", "attn_floor", "logz_drift")},
    **{f"shadow_{n}": f"shadow.{n}" for n in (
        "modules", "dtype", "model", "rel_warn", "rel_critical", "growth", "growth_floor",
        "baseline")},
    **{n: f"range.{n}" for n in (
        "overflow_warn", "overflow_critical", "underflow_warn", "underflow_critical",
        "min_numel")},
    "incident_warn_bits": "incidents.warn_bits",
    "incident_critical_bits": "incidents.critical_bits",
    "alert_cooldown": "incidents.cooldown",
    "update_stats": "update.stats",
    "update_spike_bits": "update.spike_bits",
    "update_window": "update.window",
    "update_min_history": "update.min_history",
    "weight_update_margin": "update.weight_margin",
    **{f"capture_{n}": f"capture.{n}" for n in (
        "dir", "max", "max_bytes", "retention", "snapshot", "snapshot_to", "ring")},
    "queue_size": "sinks.queue_size",
    "sink_timeout": "sinks.timeout",
    "sink_close_timeout": "sinks.close_timeout",
    "wandb_project": "sinks.wandb_project",
    "wandb_run": "sinks.wandb_run",
    "wandb_stats": "sinks.dashboard_stats",
    "dashboard_stats": "sinks.dashboard_stats",
    "dashboard_histograms": "sinks.dashboard_histograms",
    **{f"dist_{n}": f"dist.{n}" for n in ("mode", "flush_every", "divergence", "backend",
                                         "timeout", "merge")},
    "on_nonfinite": "guard.on_nonfinite",
    "rerun_skipped": "guard.rerun_skipped",
}

# The sub-config fields of Config and, for two of them, the field a plain list stands for.
GROUPS = ("drift", "spike", "shadow", "range", "update", "incidents", "capture", "sinks", "dist",
          "guard")
SHORTHAND = {"capture": "triggers", "sinks": "use"}


def _dropped(flat: str, value: Any) -> bool:
    # an empty wandb_stats meant "dashboard_stats decides"; a list replaced dashboard_stats
    return flat == "wandb_stats" and not value


def split_flat(kw: Mapping[str, Any], known: tuple[str, ...],
               where: str = "Config") -> tuple[dict, dict]:
    """(the keys that are fields, {group: {field: value}} from the flat keys). An unknown key
    raises UnknownFieldError with the closest spelling; a flat key warns, naming its new
    spelling."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for k, v in kw.items():
        if k in known:
            direct[k] = v
            continue
        new = FLAT_NAMES.get(k)
        if new is None:
            raise UnknownFieldError(f"unknown {where} field {k!r}{suggest(k, known)}")
        group, _, sub = new.partition(".")
        warnings.warn(f"{where} field {k!r} is deprecated: use {new!r} (Config({group}="
                      f"{_class(group)}({sub}=...)), or key {sub!r} in the [{group}] table of a "
                      f"config file)", DeprecationWarning, stacklevel=_user_level())
        if not _dropped(k, v):
            group, _, sub = new.partition(".")
            nested.setdefault(group, {})[sub] = v
    return direct, nested


def _user_level() -> int:
    """The stacklevel of the first frame outside the config modules (and the __init__ that
    dataclasses generates in them): the line that used the flat name."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_globals.get("__name__", "").startswith("stabilitywatch.config"):
        f, level = f.f_back, level + 1
    return level


def suggest(word: str, known: tuple[str, ...]) -> str:
    """'; did you mean ...' over the fields, the nested spellings and the flat ones (shown in
    their nested spelling)."""
    choices = list(known) + list(FLAT_NAMES)
    hint = did_you_mean(word, choices)
    if hint:
        name = hint.split("'")[1]
        hint = f"; did you mean {FLAT_NAMES.get(name, name)!r}?"
    return hint


def _class(group: str) -> str:
    return {"range": "RangeConfig", "update": "UpdateConfig", "incidents": "IncidentConfig",
            "sinks": "SinkConfig", "dist": "DistConfig", "guard": "GuardConfig",
            "drift": "DriftConfig", "spike": "SpikeConfig", "shadow": "ShadowConfig",
            "capture": "CaptureConfig"}[group]
