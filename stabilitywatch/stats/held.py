"""Records held back so that many tensors share one launch (StatsBuffer.add).

A sampled step records every watched module's output in its forward hook and every output
gradient in its backward hook: one launch each costs ~30 us of host time for the launch and as
much again for the bookkeeping around it, on a step whose host already keeps the GPU waiting.
Held here instead, they go to the buffer's multi-tensor launches (add_many) a few at a time,
whose plans repeat from step to step.

A held tensor is read later than its hook ran: each keeps its version counter, and one written
in place since (a ReLU(inplace=True) after the module) is not read at all this step; its
(module, role) is read at its hook from then on. Holding keeps tensors alive a little longer:
at most FLUSH_BYTES of them at once, and none larger than HOLD_MAX_BYTES.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

# a tensor this large gains nothing from sharing a launch, and holding it would keep its memory
HOLD_MAX_BYTES = 32 << 20
# held tensors are launched together when they reach either limit
FLUSH_BYTES = 128 << 20
FLUSH_COUNT = 64


class Held:
    def __init__(self):
        self.items: list = []          # (tensor, module, role, scale) as add_many takes them
        self.versions: list[int] = []
        self.phase: Optional[int] = None
        self.device: Optional[torch.device] = None
        self.nbytes = 0
        # forward hooks run on the training thread, backward hooks on autograd's device threads
        self.lock = threading.Lock()
        # (module, role) written in place after its hook: read at the hook
        self.immediate: set = set()

    def put(self, t: torch.Tensor, module: str, role: str, phase: int, nbytes: int) -> bool:
        """Hold t; True when the held tensors should be launched now."""
        with self.lock:
            self.items.append((t, module, role, 1.0))
            self.versions.append(t._version)
            self.phase, self.device = phase, t.device
            self.nbytes += nbytes
            return self.nbytes >= FLUSH_BYTES or len(self.items) >= FLUSH_COUNT

    def fits(self, t: torch.Tensor, phase: int) -> bool:
        """t may join the tensors held now (one phase and one device per launch)."""
        return not self.items or (phase == self.phase and t.device == self.device)

    def take(self) -> tuple[list, list, Optional[int]]:
        """The held tensors still as their hooks saw them, those written in place since, and
        their phase; nothing is held after."""
        with self.lock:
            items, versions, phase = self.items, self.versions, self.phase
            self.items, self.versions, self.nbytes = [], [], 0
        kept, moved = [], []
        for item, version in zip(items, versions):
            (kept if item[0]._version == version else moved).append(item)
        return kept, moved, phase

    def clear(self) -> None:
        with self.lock:
            self.items, self.versions, self.nbytes = [], [], 0
