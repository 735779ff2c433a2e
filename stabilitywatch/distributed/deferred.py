"""The flush's reductions on the job's own process group, queued on the device and read a step
end later: the host never waits for a collective (`dist.backend="default"`, and "auto" on NCCL).

Each collective of a flush's plan (rounds.plan) is started where the plan asks for it: the
packed numpy buffer goes to pinned host memory, then to the device with a non-blocking copy;
the all-reduce is issued asynchronously on the job's group, so NCCL queues it on its stream in
issue order with the job's own collectives (every rank issues them at the same step end), and
`work.wait()` makes the current stream, not the host, wait for it; the result goes back to
pinned memory with a non-blocking copy and a CUDA event, as the frames do. At the next step end
the event has almost always fired (the frames of that step were read the same way), the result
is handed to the plan, and its next collective is started. A flush of R rounds delivers its
frames R step ends after it started; flushes overlap, one round each per step end, in the same
order on every rank.

On CPU tensors (a gloo job group) the same path runs with the collective's work object in
place of the event: started at one step end, waited for at the next.

A collective of the job's group that fails fails the job, as the job's own would: no timeout
here (a timeout would make NCCL's wait a host wait) and no detaching on a slow rank.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch


class _Op:
    """One collective in flight: its result lands in host memory."""

    def __init__(self, ops: "Ops", kind: str, a: np.ndarray):
        dist, group, device = ops.dist, ops.group, ops.device
        self.kind, self._ops = kind, ops
        dtype = np.uint8 if kind == "gather" else np.float64
        src = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        self.nbytes = src.numel() * src.element_size()
        cuda = device.type == "cuda"
        self._staged = None
        if cuda:
            self._staged = ops.pinned(src.dtype, src.shape)
            self._staged.copy_(src)
            t = self._staged.to(device, non_blocking=True)
        else:
            t = src.clone()
        if kind == "gather":
            self.world = dist.get_world_size(group)
            out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            self._work = gather(out, t, group=group, async_op=True)
            self.width = t.numel()
        else:
            red = dist.ReduceOp.MAX if kind == "max" else dist.ReduceOp.SUM
            self._work = dist.all_reduce(t, op=red, group=group, async_op=True)
            out = t
        self._event = None
        if cuda:
            self._work.wait()        # a stream wait on NCCL (no timeout given: not a host wait)
            self._host = ops.pinned(out.dtype, out.shape)
            self._host.copy_(out, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._host = out

    def result(self):
        """The reduced array (or the gathered buffers, in rank order); waits if it has not
        landed yet (off the step's path: a step end after it started)."""
        if self._event is not None:
            self._event.synchronize()
        else:
            self._work.wait()
        got = self._host.numpy().copy()   # sync-ok: landed (event or work done)
        if self._event is not None:       # the copies through them are done: reused
            self._ops.give_back(self._staged, self._host)
        if self.kind == "gather":
            rows = got.reshape(self.world, self.width)
            return [rows[r] for r in range(self.world)]
        return got


class Ops:
    """Starts the plans' collectives on one process group and device; counts them."""

    POOL = 32     # pinned buffers kept for reuse

    def __init__(self, dist, group, device: torch.device):
        self.dist, self.group, self.device = dist, group, device
        self.calls = 0
        self.bytes_sent = 0
        self._pool: dict = {}

    def pinned(self, dtype, shape) -> torch.Tensor:
        """Pinned host memory: a pinned allocation of its own each round would block the host
        (cudaHostAlloc); a flush's rounds repeat their sizes, so buffers are reused."""
        got = self._pool.get((dtype, tuple(shape)))
        return got.pop() if got else torch.empty(shape, dtype=dtype, pin_memory=True)

    def give_back(self, *bufs) -> None:
        for b in bufs:
            if b is not None and sum(map(len, self._pool.values())) < self.POOL:
                self._pool.setdefault((b.dtype, tuple(b.shape)), []).append(b)

    def start(self, kind: str, a: np.ndarray) -> _Op:
        op = _Op(self, kind, a)
        self.calls += 1
        self.bytes_sent += op.nbytes
        return op


@dataclass
class Flight:
    gen: Any                       # rounds.plan(...)
    ctx: Any                       # what the caller needs to turn the result into frames
    op: Optional[Any] = None       # the collective in flight
    result: Any = None             # the plan's Reduced, once done


class Flights:
    """Flushes in flight, advanced one collective each per step end, oldest first."""

    def __init__(self, ops):
        self.ops = ops
        self.queue: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def start(self, gen, ctx) -> None:
        """A new flush: its first collective starts now."""
        f = Flight(gen=gen, ctx=ctx)
        self.queue.append(f)
        self._send(f, None, first=True)

    def advance(self) -> list:
        """Every flight's collective started at the previous step end is read and its next one
        started; the flights that finished, oldest first and each after every older one (a
        flush with more rounds holds back the younger ones): [(ctx, Reduced)]. A plan that
        stopped (ranks that close and ranks that go on) ends the advance at once on every rank:
        the finished flights come back, the stopped one last; the caller abandons the rest."""
        stop = False
        for f in list(self.queue):
            if f.op is None:
                continue          # finished, waiting for an older one
            self._send(f, f.op.result())
            if f.op is None and _stopped(f.result):
                stop = True
                break
        done = []
        if stop:
            for f in [f for f in self.queue if f.op is None]:
                self.queue.remove(f)
                done.append((f.ctx, f.result))
            return sorted(done, key=lambda d: _stopped(d[1]))
        while self.queue and self.queue[0].op is None:
            f = self.queue.popleft()
            done.append((f.ctx, f.result))
        return done

    def drain(self) -> list:
        """Every flight run to its end, reading each result as it comes (at close); stops at
        a plan that stopped."""
        done = []
        while self.queue and not any(_stopped(r) for _, r in done):
            done += self.advance()
        return done

    def abandon(self) -> list:
        """The contexts of the flights still in flight (a failed path: their frames go local)."""
        out = [f.ctx for f in self.queue]
        self.queue.clear()
        return out

    def _send(self, f: Flight, value, first: bool = False) -> None:
        try:
            kind, a = next(f.gen) if first else f.gen.send(value)
        except StopIteration as stop:
            f.op, f.result = None, stop.value
            return
        f.op = self.ops.start(kind, a)


def _stopped(result) -> bool:
    return bool(getattr(result, "stopped", False))
