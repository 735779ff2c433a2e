"""What the statistics buffer needs from whatever computes a row: a small table of functions.

stats/ sits below kernels/ (the kernels write rows laid out by stats/layout.py), so the buffer
cannot import the kernels: it is handed a `RowBackend`. `TORCH` here is the pure-torch
reference; `stabilitywatch.kernels.backend.kernel_backend(name)` gives the one that launches the
Triton kernels where they run. Every function must run without a host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .layout import merge_into
from .reference import reference_row


@dataclass(frozen=True)
class RowBackend:
    """The functions take the backend's `name` as their last argument (as kernels/dispatch.py's
    do): the buffer passes it on each call, which costs less than binding it."""
    name: str
    # merge the statistics of t into one float64 row: (t, row, scale, name) -> None
    accumulate: Callable
    # one launch for many tensors: (tensors, rows, slots) -> [(launch, [(index, offset)])]; the
    # launches have run(rows) and rebind(addresses) to repeat them (stats/plans.py)
    accumulate_many: Callable
    # (t, scale, name) -> bool: t may go to accumulate_many (small tensors / large tiled ones)
    batchable: Callable
    tileable: Callable
    # t -> bool: a launch reads t's own memory (not a copy), so its address may be kept
    viewable: Callable
    # (t, name) -> bool, and (grads, out, rows) -> launch with run(out)/rebind(addresses): the
    # gradient sentinel's kernel; None where only the twin in stats/sentinel.py runs
    sentinel_launchable: Optional[Callable] = None
    sentinel_launch: Optional[Callable] = None
    # the CPU path (stats/cpu.py): ([(t, rows, slot, scale)], name) -> None, the rows of many
    # tensors in one set of passes; and (t, rows, scale, name) -> float or None, the host scale
    # under which a small CPU tensor may wait in the buffer's stage (None: not staged). None:
    # one accumulate per tensor, nothing staged
    accumulate_each: Optional[Callable] = None
    host_scale_of: Optional[Callable] = None


def _reference_accumulate(t: torch.Tensor, row: torch.Tensor, scale=1.0, name="torch") -> None:
    if t.numel():
        merge_into(row, reference_row(t, scale))


def _never(*_args) -> bool:
    return False


def _no_launch(*_args) -> list:
    raise RuntimeError("stabilitywatch: the pure-torch backend has no multi-tensor launch")


TORCH = RowBackend("torch", _reference_accumulate, _no_launch, _never, _never, _never)
