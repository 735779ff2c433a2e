"""Host staging: at the end of a step the touched rows go to pinned host memory with a
non-blocking copy and a CUDA event; a step's frame is read once its events have completed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .device_rows import DeviceRows
from .frame import StatsFrame
from .layout import N_STATS
from .sentinel import SentinelFrame
from .sentinel_store import SentinelPending
from .slots import SlotTable

UNSEEN = 1 << 30  # sequence number of rows written by compiled code (order unknown)


@dataclass
class Pending:
    step: int
    touched: list[tuple[int, int, int]]                # (phase, seq, slot)
    copies: list[tuple[DeviceRows, torch.Tensor, Optional[object]]]
    sentinel: Optional[SentinelPending] = None

    def ready(self) -> bool:
        return (all(ev is None or ev.query() for _, _, ev in self.copies)
                and (self.sentinel is None or self.sentinel.ready()))

    def wait(self) -> None:
        for _, _, ev in self.copies:
            if ev is not None:
                ev.synchronize()
        if self.sentinel is not None:
            self.sentinel.wait()


def start_copies(devs, spans: Optional[dict]) -> list:
    """Copy rows [lo, hi) of each device (spans: device -> (lo, hi); None: every row) to a
    host buffer; never waits. Returns (rows, host buffer, event or None) per device."""
    copies = []
    for dev in devs:
        host = dev.host_buffer()
        lo, hi = (0, dev.rows.shape[0]) if spans is None else spans.get(dev.device, (0, 0))
        if hi <= lo:
            copies.append((dev, host, None))
            continue
        both = torch.cat([dev.rows[lo:hi], dev.scale[lo:hi]], 1)
        if dev.device.type == "cuda":
            host[lo:hi].copy_(both, non_blocking=True)
            ev = dev.event()
            ev.record(torch.cuda.current_stream(dev.device))
        else:
            host[lo:hi].copy_(both)
            ev = None
        copies.append((dev, host, ev))
    return copies


def read_frame(p: Pending, slots: SlotTable, sentinel: Optional[SentinelFrame], rank: int,
               world_size: int) -> StatsFrame:
    """The frame of a landed step; its host buffers go back to their pools."""
    host_of = {dev.device: host.numpy() for dev, host, _ in p.copies}  # sync-ok: copy done
    keep, rows, scales = [], [], []
    for ph, seq, slot in p.touched:
        host = host_of[slots.device_of[slot]]
        if seq == UNSEEN and host[slot, 0] == 0:  # a slot compiled code did not write
            continue
        keep.append((ph, slot))
        rows.append(host[slot, :N_STATS])
        scales.append(float(host[slot, N_STATS]) if slot in slots.tensor_scaled
                      else slots.scales[slot])
    for dev, host, ev in p.copies:
        if host.shape[0] == dev.rows.shape[0]:
            dev.pinned_pool.append(host)
        if ev is not None:   # completed: the step was read
            dev.events.append(ev)
    table = np.array(rows, dtype=np.float64).reshape(len(rows), N_STATS)
    return StatsFrame(step=p.step, keys=[slots.keys[s] for _, s in keep], rows=table,
                      scales=scales, phases=[ph for ph, _ in keep], rank=rank,
                      world_size=world_size, sentinel=sentinel)
