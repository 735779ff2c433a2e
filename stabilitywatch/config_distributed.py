"""Validation of the `# -- distributed` block of Config (README "Many GPUs: torchrun").

Kept apart from config.py like config_detectors.py: it imports nothing from the package
(config.py imports it)."""
from __future__ import annotations

import enum
import math


class DistMode(str, enum.Enum):
    """Who writes what when torch.distributed runs with more than one rank."""
    RANK0 = "rank0"          # rank 0 merges every rank's rows and alone writes the run's files
    PER_RANK = "per_rank"    # every rank writes its own rows to its own files


class DistBackend(str, enum.Enum):
    """Which process group carries the flush collective."""
    GLOO = "gloo"            # a CPU gloo side group made at watch(): never touches the GPU streams
    DEFAULT = "default"      # the job's default group (NCCL: the payload goes through the GPU)


class DistMerge(str, enum.Enum):
    """How a flush combines the ranks' rows."""
    REDUCE = "reduce"        # all-reduce (SUM, MAX) of packed rows: bytes per rank O(rows)
    GATHER = "gather"        # one all-gather of every rank's rows: bytes received O(world x rows)


def validate_dist_fields(cfg, set_) -> None:
    for name, kind in (("dist_mode", DistMode), ("dist_backend", DistBackend),
                       ("dist_merge", DistMerge)):
        v = getattr(cfg, name)
        try:
            set_(name, kind(v.value if isinstance(v, enum.Enum) else v))
        except ValueError:
            raise ValueError(f"Config.{name}: {v!r} is not one of "
                             f"{[m.value for m in kind]}") from None
    v = cfg.dist_flush_every
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Config.dist_flush_every must be an integer >= 1, got {v!r}")
    if not isinstance(cfg.dist_divergence, bool):
        raise ValueError(f"Config.dist_divergence must be True or False, "
                         f"got {cfg.dist_divergence!r}")
    v = cfg.dist_timeout
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"Config.dist_timeout must be a finite number of seconds > 0, got {v!r}")
    set_("dist_timeout", float(v))
