"""What the distributed layer needs from the run it serves: a few facts and one callable, not
the Monitor (the layer sits below it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from ..config import Config


class FrameSource(Protocol):
    """The statistics buffer's side the coordinator reads (stats.buffer.StatsBuffer)."""

    @property
    def pending(self) -> int: ...

    def poll(self, block: bool = False, rank: int = 0, world_size: int = 1,
             limit: Optional[int] = None) -> list: ...


def _nothing(frame) -> None:
    return None


@dataclass(frozen=True)
class RunInfo:
    rank: int                 # the rank the run's records carry (Config.rank overrides)
    world_size: int
    config: "Config"          # the run's Config: its dist_* fields
    has_optimizer: bool       # gradients are read after the all-reduce (optimizer pre-step)
    # a frame this rank reads but does not process (rank0 mode, ranks > 0): frees what it holds
    release: Callable[[Any], None] = _nothing
