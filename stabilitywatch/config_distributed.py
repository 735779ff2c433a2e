"""The distributed sub-config (`Config.dist`; README "Many GPUs: torchrun"). Used only when
torch.distributed runs with more than one rank.

It imports nothing from the package but config_base (config.py imports it)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .config_base import check_bool, check_enum, check_int, check_number


class DistMode(str, enum.Enum):
    """Who writes what when torch.distributed runs with more than one rank."""
    RANK0 = "rank0"          # rank 0 merges every rank's rows and alone writes the run's files
    PER_RANK = "per_rank"    # every rank writes its own rows to its own files


class DistBackend(str, enum.Enum):
    """Which process group carries the flush collectives."""
    AUTO = "auto"            # the job's group when it is NCCL (on the device), else gloo
    GLOO = "gloo"            # a CPU gloo side group made at watch(): never touches the GPU streams
    DEFAULT = "default"      # the job's default group (NCCL: on the device, read a step later)


class DistMerge(str, enum.Enum):
    """How a flush combines the ranks' rows."""
    REDUCE = "reduce"        # all-reduce (SUM, MAX) of packed rows: bytes per rank O(rows)
    GATHER = "gather"        # one all-gather of every rank's rows: bytes received O(world x rows)


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """How ranks exchange and write their rows."""
    mode: DistMode = DistMode.RANK0
    """"rank0": at each flush every rank's rows go to rank 0 in one collective; rank 0 merges
    them (activations and shards: sums add, min/max combine; replicated tensors: its own row)
    and alone writes alerts.jsonl and stats.jsonl. "per_rank": every rank writes its own rows
    to its own files (alerts.rank{r}.jsonl...); only fingerprints are exchanged."""
    flush_every: int = 1
    """Collective flush at every N-th step end (the same step on every rank), carrying the
    frames of the steps before it; alerts arrive up to N steps later. Keep capture.ring >= N + 1
    for captures."""
    divergence: bool = True
    """Compare fingerprints of parameters, gradients and optimizer state across ranks (they
    must be identical under DDP) and name the rank that differs (detector "divergence"). Switch
    off when ranks hold different plain-tensor parameters (pipeline or tensor parallelism
    without DTensor)."""
    backend: DistBackend = DistBackend.AUTO
    """"auto": the job's own group when it is NCCL (as "default"), else "gloo". "default": the
    job's default group; with merge="reduce" each reduction is queued on the current stream
    (ordered with the job's collectives), its result read at the next step end, so the host
    never waits for it and a flush's frames come one step end per round later; a failing
    collective fails the job, as its own would. "gloo": a CPU gloo side group made at watch()
    (never touches the GPU streams), with the bounded `timeout` and per-rank files after it;
    CPU jobs, and merge="gather", use it under "auto"."""
    timeout: float = 300.0
    """Seconds a flush collective on the gloo side group may take; after that (a rank died)
    each rank goes on alone, writing per-rank files."""
    merge: DistMerge = DistMerge.REDUCE
    """"reduce": a flush is a few all-reduces (SUM, MAX) of packed rows, the same bytes per
    rank at any world size; ranks are named by the extremes of their ids (docs/distributed.md).
    "gather": one all-gather of every rank's rows (each rank receives world x its rows)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", check_enum(DistMode, self.mode, "dist.mode"))
        object.__setattr__(self, "backend", check_enum(DistBackend, self.backend, "dist.backend"))
        object.__setattr__(self, "merge", check_enum(DistMerge, self.merge, "dist.merge"))
        check_int(self.flush_every, "dist.flush_every", 1)
        check_bool(self.divergence, "dist.divergence")
        object.__setattr__(self, "timeout", check_number(
            self.timeout, "dist.timeout", 0.0, strict=True, what="a finite number of seconds"))
