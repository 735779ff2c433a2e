"""The device rows: per device, a float64 [capacity x N_STATS] tensor holding the rows of the
step in flight, the column of tensor-valued scales, and the pinned host buffers they go to."""
from __future__ import annotations

import torch

from .layout import ROW_DTYPE, init_row_tensor


class DeviceRows:
    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        # one extra column: the scale of tensor-valued scales (FP8 recipes), read with the rows
        self.rows = _static(init_row_tensor(device, capacity))
        self.views = self.rows.unbind(0)  # one view per row, made once (indexing costs ~3 us)
        self.scale = torch.ones(capacity, 1, dtype=ROW_DTYPE, device=device)
        self.init = init_row_tensor(device, capacity)
        self.pinned_pool: list[torch.Tensor] = []
        self.events: list = []   # CUDA events of read steps, recorded again (none made per step)
        self.retired: list[torch.Tensor] = []   # rows replaced by grow()
        # rows [lo, hi) may hold writes since their last reset; the rest hold the identity row
        self.dirty = (0, 0)

    def mark(self, lo: int, hi: int) -> None:
        self.dirty = union(self.dirty, (lo, hi))

    def reset(self, every_row: bool = False) -> None:
        lo, hi = (0, self.rows.shape[0]) if every_row else self.dirty
        if hi > lo:
            self.rows[lo:hi].copy_(self.init[lo:hi])
        self.dirty = (0, 0)

    def reset_row(self, slot: int) -> None:
        self.mark(slot, slot + 1)
        self.views[slot].copy_(self.init[slot])

    def grow(self, capacity: int) -> None:
        # keep rows already written this step (device copy, no sync). The old rows stay
        # allocated: a CUDA graph that captured a compiled backward's record writes them (where
        # nothing reads it) until it is recorded again, never memory handed to something else
        self.retired.append(self.rows)
        rows = _static(init_row_tensor(self.device, capacity))
        rows[: self.rows.shape[0]].copy_(self.rows)
        scale = torch.ones(capacity, 1, dtype=ROW_DTYPE, device=self.device)
        scale[: self.scale.shape[0]].copy_(self.scale)
        self.rows, self.scale = rows, scale
        self.views = rows.unbind(0)
        self.init = init_row_tensor(self.device, capacity)
        self.pinned_pool.clear()

    def event(self):
        return self.events.pop() if self.events else torch.cuda.Event()

    def host_buffer(self) -> torch.Tensor:
        if self.pinned_pool:
            return self.pinned_pool.pop()
        pin = self.device.type == "cuda"
        shape = (self.rows.shape[0], self.rows.shape[1] + 1)
        return torch.empty(shape, dtype=ROW_DTYPE, pin_memory=pin)


def union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The smallest span holding both spans (an empty one, lo >= hi, adds nothing)."""
    if a[1] <= a[0]:
        return b
    if b[1] <= b[0]:
        return a
    return min(a[0], b[0]), max(a[1], b[1])


def _static(rows: torch.Tensor) -> torch.Tensor:
    # Compiled code writes the rows through the accumulate_row custom op: a tensor that keeps
    # its address lets inductor's CUDA graphs take the mutation (else it skips the graph)
    if rows.device.type == "cuda":
        try:
            torch._dynamo.mark_static_address(rows)
        except Exception:  # an older torch: CUDA graphs skip these graphs, nothing else changes
            pass
    return rows
