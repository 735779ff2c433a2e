"""DTensor inputs (FSDP2 `fully_shard`, tensor parallel): the statistics read the local shard.

`to_local(t)` returns (local tensor, placement) where placement is None for a plain tensor and
(sharded, owner) for a DTensor: `sharded` when any mesh dimension shards it (its rows merge
across ranks into the unsharded tensor's statistics), `owner` when this rank's row counts in
that merge (its coordinate is 0 on every mesh dimension that replicates the tensor, so HSDP
replicas are counted once). Host-only bookkeeping: no collective, no sync.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=1)
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except Exception:  # torch without distributed support
        return None


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def placement(t: torch.Tensor) -> Optional[tuple[bool, bool]]:
    """(sharded, owner) of a DTensor; None for a plain tensor."""
    if not is_dtensor(t):
        return None
    places = tuple(t.placements)
    sharded = any(p.is_shard() for p in places)
    try:
        coord = t.device_mesh.get_coordinate()
    except Exception:
        coord = None
    if coord is None:   # this rank is not on the tensor's mesh: nothing of it lives here
        return sharded, False
    owner = all(c == 0 for c, p in zip(coord, places) if not p.is_shard())
    return sharded, owner


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view, no communication); other tensors unchanged."""
    return t.to_local() if is_dtensor(t) else t


def shard_rows(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(dim-0 size of the unsharded tensor, ranks) of a DTensor sharded along dim 0 on a 1-D
    mesh (FSDP2's layout), else None: which rows a rank holds follows from them."""
    if not is_dtensor(t):
        return None
    try:
        places = tuple(t.placements)
        if len(places) != 1 or not places[0].is_shard() or places[0].dim != 0 or t.dim() == 0:
            return None
        return int(t.shape[0]), int(t.device_mesh.size())
    except Exception:
        return None
