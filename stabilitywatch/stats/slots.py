"""The slot table: (module, role) pairs numbered on the host as they first appear, with what
each slot's row needs to be read back (scale, device, phase)."""
from __future__ import annotations

from typing import Optional

import torch


class SlotTable:
    def __init__(self, capacity: int):
        # per-slot lists, all the same length; read in place by the buffer's hot path (it keeps
        # references to them), so they are extended, never replaced
        self.keys: list[tuple[str, str]] = []
        self.scales: list[float] = []
        self.device_of: list[Optional[torch.device]] = []
        self.phase_of: list[int] = []
        self.slot_of: dict[tuple[str, str], int] = {}
        self.tensor_scaled: set[int] = set()   # slots whose scale is a device tensor
        self.capacity = capacity               # rows every device's table holds

    def __len__(self) -> int:
        return len(self.keys)

    def grown_capacity(self) -> Optional[int]:
        """The capacity a new slot needs, when the rows must grow first; else None."""
        n = len(self.keys)
        return max(2 * self.capacity, n + 1) if n >= self.capacity else None

    def add(self, key: tuple[str, str], scale: "float | torch.Tensor", phase: int = 0) -> int:
        # what can fail (the scale's value) comes before the slot enters any of the lists
        value = 1.0 if isinstance(scale, torch.Tensor) else float(scale)
        slot = len(self.keys)
        self.phase_of.append(phase)
        self.keys.append(key)
        self.scales.append(value)
        self.device_of.append(None)
        self.slot_of[key] = slot
        return slot

    def spans(self, slots) -> dict:
        """device -> (lo, hi): the span of the given slots' rows on each device."""
        slots = list(slots)
        devices = set(map(self.device_of.__getitem__, slots))
        if len(devices) == 1:   # the usual case, in builtins: a sampled step touches ~600 slots
            return {devices.pop(): (min(slots), max(slots) + 1)}
        spans: dict = {}
        for slot in slots:
            d = self.device_of[slot]
            lo, hi = spans.get(d, (slot, slot + 1))
            spans[d] = (min(lo, slot), max(hi, slot + 1))
        return spans
