"""The public `stabilitywatch.replay`: capture/replay.py's replay, re-running the step under
this package's Monitor (capture/ does not import the Monitor; it is handed in here)."""
from __future__ import annotations

import functools
from pathlib import Path

from .capture import replay as _capture_replay
from .monitor import watch


@functools.wraps(_capture_replay.replay)
def replay(capture: "str | Path", **kwargs) -> dict:
    kwargs.setdefault("watch", watch)
    return _capture_replay.replay(capture, **kwargs)
