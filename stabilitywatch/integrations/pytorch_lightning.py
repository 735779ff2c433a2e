"""The Lightning callback for the `pytorch_lightning` package (the same callback as
stabilitywatch.integrations.lightning, on pytorch_lightning's Callback class)."""
from __future__ import annotations

from typing import Any

from .lightning import REPLAY_STEP, _make, replay_step  # noqa: F401


def __getattr__(name: str) -> Any:
    if name != "StabilityWatchCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from pytorch_lightning import Callback
    except ImportError as e:
        raise ImportError("this StabilityWatchCallback needs pytorch_lightning") from e
    cls = globals()["StabilityWatchCallback"] = _make(Callback, __name__)
    return cls
