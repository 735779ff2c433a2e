"""Checks of the Detector instances in Config.detectors (README "Your own detector and sink"):
each entry is a built-in detector's name or an object with a `name` and a `check(frame)`."""
from __future__ import annotations

from .alert import DETECTORS
from .config_base import did_you_mean


def check_detector_entries(entries: tuple, names: tuple) -> None:
    """names: the built-in detectors Config.detectors may name. Raises ValueError naming the
    entry at fault."""
    seen: dict = {}
    for d in entries:
        if isinstance(d, str):
            if d not in names:
                raise ValueError(f"Config.detectors: unknown detector {d!r}"
                                 f"{did_you_mean(d, names)}; expected any of "
                                 f"{names} (nonfinite/overflow/underflow are always on) or a "
                                 f"stabilitywatch.Detector instance")
            key = d
        elif isinstance(d, type):
            raise ValueError(f"Config.detectors: {d.__name__} is a class; pass an instance, "
                             f"{d.__name__}(...)")
        elif not callable(getattr(d, "check", None)):
            raise ValueError(f"Config.detectors must hold detector names {names} or objects "
                             f"with a check(frame) method (stabilitywatch.Detector), got {d!r} "
                             f"({type(d).__name__})")
        else:
            name = getattr(d, "name", None)
            if not isinstance(name, str) or not name:
                raise ValueError(f"Config.detectors: {type(d).__name__} needs a `name` of its "
                                 f"own (a non-empty string, the Alert.detector of its alerts), "
                                 f"got {name!r}")
            if name in DETECTORS:
                raise ValueError(f"Config.detectors: {type(d).__name__}.name {name!r} is a "
                                 f"built-in detector's name; choose another")
            key = name
        if key in seen:
            raise ValueError(f"Config.detectors: {key!r} appears twice")
        seen[key] = d
