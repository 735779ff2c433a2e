"""The statistics as registered custom ops, so that hooks inside a torch.compile'd model are
traced into the graph (no graph break) and the ops run at their place in the compiled program:
- `torch.ops.stabilitywatch.accumulate_row(rows, slot, x, scale, backend)` merges the
  statistics of x into rows[slot] (Triton on CUDA, the pure-torch reference elsewhere): the
  forward's records, the rows a graph input (a static address for CUDA graphs);
- `torch.ops.stabilitywatch.accumulate_slot(x, owner, slot, scale, backend)` does the same into
  the rows of a registered owner, looked up when the op runs: the records of a compiled
  backward. A backward can only take tensors its forward saved, and autograd refuses a saved
  tensor written since (the rows are written by every graph and eager record of the step), so
  the backward's op takes no rows tensor; it is kept from dead-code elimination by name.
"""
from __future__ import annotations

import weakref

import torch

from .dispatch import accumulate

# owner id -> the object whose rows_of(device) the backward's records go to (a StatsBuffer):
# a custom op takes no Python object, so the owner is named by a number
_OWNERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_owner(owner) -> int:
    """The number accumulate_slot knows `owner` by (while owner lives)."""
    _OWNERS[id(owner)] = owner
    return id(owner)


@torch.library.custom_op("stabilitywatch::accumulate_row", mutates_args=("rows",))
def accumulate_row(rows: torch.Tensor, slot: int, x: torch.Tensor, scale: float,
                   backend: str) -> None:
    accumulate(x, rows[slot], scale, backend)


@accumulate_row.register_fake
def _(rows, slot, x, scale, backend) -> None:
    return None


@torch.library.custom_op("stabilitywatch::accumulate_slot", mutates_args=())
def accumulate_slot(x: torch.Tensor, owner: int, slot: int, scale: float, backend: str) -> None:
    buf = _OWNERS.get(owner)
    if buf is not None:
        accumulate(x, buf.rows_of(x.device)[slot], scale, backend)


@accumulate_slot.register_fake
def _(x, owner, slot, scale, backend) -> None:
    return None


try:
    torch.fx.node.has_side_effect(torch.ops.stabilitywatch.accumulate_slot.default)
except AttributeError:  # an older torch: its graphs keep ops without outputs as they are
    pass
