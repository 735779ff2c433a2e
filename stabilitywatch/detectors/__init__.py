"""Detectors: host-side objects with `check(frame) -> list[Alert]`, frames in step order."""
from __future__ import annotations

from ..config import Config
from .base import Cooldown, Detector
from .drift import DriftDetector
from .nonfinite import NonFiniteDetector
from .physics import PhysicsDetector
from .range import RangeDetector
from .shadow import ShadowDetector
from .spike import SpikeDetector
from .update import UpdateDetector
from .user import UserDetector

_EXTRA = {"drift": DriftDetector, "spike": SpikeDetector, "shadow": ShadowDetector}


def build_detectors(config: Config, optimizer=None, modules=()) -> list[Detector]:
    """The always-on detectors (nonfinite, overflow/underflow, and with an optimizer the
    physics of weight updates), then those of `config.detectors` (names, or your own Detector
    instances), in the order they run on each frame."""
    dets: list[Detector] = [NonFiniteDetector(remind_every=max(1, config.incidents.cooldown)),
                            RangeDetector(config)]
    if optimizer is not None:
        dets.append(PhysicsDetector(config, optimizer, list(modules)))
    dets += [_EXTRA[d](config) if isinstance(d, str) else UserDetector(d)
             for d in config.detectors]
    if config.update.stats and "spike" in config.detectors:   # ||dW|| / ||W|| spikes
        dets.append(UpdateDetector(config))
    return dets


__all__ = ["Cooldown", "Detector", "DriftDetector", "NonFiniteDetector", "PhysicsDetector",
           "RangeDetector", "ShadowDetector", "SpikeDetector", "UpdateDetector", "UserDetector", "build_detectors"]
