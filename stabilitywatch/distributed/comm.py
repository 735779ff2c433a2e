"""The collectives of a flush on numpy buffers, run at once, with a bounded wait and byte
counts: the gloo side group's, and the all-gather (dist.merge="gather") on any group.

On the gloo side group the buffers stay in host memory; on the job's NCCL group (the
all-gather there) they go to the current device and back, and the host waits at the flush.
The reduction on the job's group is queued instead (deferred.py)."""
from __future__ import annotations

import datetime

import numpy as np
import torch


class Comm:
    def __init__(self, dist, group, device: torch.device, timeout: datetime.timedelta):
        self.dist, self.group, self.device, self.timeout = dist, group, device, timeout
        self.calls = 0
        self.bytes_sent = 0       # this rank's contribution to every collective so far

    def _wait(self, work) -> None:
        work.wait(timeout=self.timeout)
        self.calls += 1

    def all_reduce(self, a: np.ndarray, op: str) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(self.device)
        red = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        self._wait(self.dist.all_reduce(t, op=red, group=self.group, async_op=True))
        self.bytes_sent += t.numel() * 8
        return t.cpu().numpy()   # sync-ok: the flush, off the hot path

    def all_gather(self, buf: np.ndarray) -> list:
        """Every rank's equal-sized uint8 buffer, in rank order."""
        inp = torch.from_numpy(np.ascontiguousarray(buf, dtype=np.uint8)).to(self.device)
        world = self.dist.get_world_size(self.group)
        out = torch.empty(world * inp.numel(), dtype=torch.uint8, device=self.device)
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        self._wait(gather(out, inp, group=self.group, async_op=True))
        self.bytes_sent += inp.numel()
        rows = out.cpu().numpy().reshape(world, inp.numel())   # sync-ok: the flush
        return [rows[r] for r in range(world)]
