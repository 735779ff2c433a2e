"""Device storage of the every-step gradient sentinel, its launches, and its copy to host memory.

Each step the taps hand over every watched parameter gradient once (`write`, before the
optimizer step); per device a float64 [rows x 3] tensor takes their sentinel (kernels/sentinel.py
on CUDA, the pure-torch twin stats/sentinel.py elsewhere); at the step end it goes to pinned
host memory with a non-blocking copy and a CUDA event, beside the statistics rows, and is read
with the step's frame one step later. The launches are kept while the gradients keep their
kinds (sizes, dtypes, order) and only take new addresses when gradients come back elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .backend import TORCH, RowBackend
from .sentinel import COLS, DTYPE, RANK_BIG, SentinelFrame, sentinel_reference
from .sentinel_cpu import host_ok, sentinel_host


class _DevSentinel:
    def __init__(self, device: torch.device, rows: int):
        self.device = device
        self.out = torch.zeros(rows, COLS, dtype=DTYPE, device=device)
        self.pool: list[torch.Tensor] = []
        self.events: list = []    # CUDA events of read steps, recorded again

    def event(self):
        return self.events.pop() if self.events else torch.cuda.Event()

    def host(self) -> torch.Tensor:
        if self.pool:
            return self.pool.pop()
        return torch.empty(self.out.shape, dtype=DTYPE, pin_memory=self.device.type == "cuda")


@dataclass
class _Plan:
    shape: tuple
    addrs: tuple
    launches: list      # (device, launch, item indices)
    rest: dict          # device -> (item indices) read by the twin


@dataclass
class SentinelPending:
    step: int
    present: np.ndarray
    numel: np.ndarray
    copies: list        # (_DevSentinel, host tensor, event or None)
    flag: Optional[tuple] = None   # (host tensor, event): the cross-rank flag, when reduced
    guarded: bool = False          # the guard handed the flag to the optimizer step

    def ready(self) -> bool:
        evs = [ev for _, _, ev in self.copies] + ([self.flag[1]] if self.flag else [])
        return all(ev is None or ev.query() for ev in evs)

    def wait(self) -> None:
        evs = [ev for _, _, ev in self.copies] + ([self.flag[1]] if self.flag else [])
        for ev in evs:
            if ev is not None:
                ev.synchronize()


class SentinelStore:
    def __init__(self, backend: RowBackend = TORCH):
        self.ops = backend
        self.keys: list[tuple[str, str]] = []   # row i: (module, role) of a gradient
        self.order: Optional[list[int]] = None  # rows in backward order, once recorded
        self._dev: dict[torch.device, _DevSentinel] = {}
        self._plan: Optional[_Plan] = None
        self._present: Optional[np.ndarray] = None
        self._flag: Optional[torch.Tensor] = None
        self._flag_pool: list[tuple] = []  # (pinned host floats, event) for the flags, reused
        self._ordered: Optional[tuple] = None    # (order, keys, index array, keys in order)
        self.launches = 0                        # steps written (tests, benchmarks)
        self.again = 0                           # of which by write_again
        self.guarded = False                     # set by the guard for the step in flight
        self._read: list[SentinelFrame] = []     # frames read since the last drain_read()
        # (addresses, present, numel) of the last step, when its gradients were every row's, in
        # row order, plain tensors, and its plan was kept: see write_again
        self._again: Optional[tuple] = None
        self._meta: Optional[tuple] = None       # present and numel in backward order, kept

    def set_keys(self, keys: list) -> None:
        self.keys = list(keys)

    # -- hot path ------------------------------------------------------------------------------
    def write(self, items: list) -> None:
        """items: (row, gradient) of every gradient present this step. No host sync."""
        present = np.zeros(len(self.keys), dtype=bool)
        numel = np.zeros(len(self.keys), dtype=np.int64)
        for r, g in items:
            present[r] = True
            numel[r] = g.numel()
        self._present, self._numel = present, numel
        for d in {g.device for _, g in items}:
            self._rows_on(d)
        for d in self._dev.values():
            d.out.zero_()
        self.launches += 1
        plan = self._plan
        sig = _signature(items)
        if (sig is not None and plan is not None and plan.shape == sig[0]
                and (plan.addrs == sig[1] or self._rebind(plan, items, sig[1]))):
            for device, launch, _ in plan.launches:
                launch.run(self._dev[device].out)
            self._twin(items, plan.rest)
        else:
            plan = self._plan = self._build(items, sig)
        whole = (plan is not None and len(items) == len(self.keys)
                 and all(r == k and type(g) is torch.Tensor for k, (r, g) in enumerate(items)))
        self._again = (list(plan.addrs), present, numel) if whole else None

    def write_again(self, params: list) -> bool:
        """The last step's write again, when params[k].grad (row k) are plain tensors at the
        addresses they had then: the per-step host work is reading those addresses, the
        zeroing and the kept launches. False (nothing done) otherwise: call write.

        Sizes, dtypes and devices are not compared: a parameter's gradient has its parameter's
        (autograd refuses others), and one at the address of the last step's, from the same
        accumulation, has its layout too."""
        again = self._again
        if again is None:
            return False
        try:
            grads = [p.grad for p in params]
            if [g.data_ptr() for g in grads] != again[0]:
                return False
        except (AttributeError, RuntimeError):   # a None gradient; a tensor without storage
            return False
        self._present, self._numel = again[1], again[2]
        for d in self._dev.values():
            d.out.zero_()
        self.launches += 1
        self.again += 1
        plan = self._plan
        for device, launch, _ in plan.launches:
            launch.run(self._dev[device].out)
        for device, ks in plan.rest.items():
            self._twin_on(device, [grads[k] for k in ks], ks)
        return True

    def flag(self, device: torch.device) -> torch.Tensor:
        """A float32 0-dim tensor on `device`: 1.0 when a gradient written this step holds
        NaN/Inf (on the device, no sync)."""
        bad = [d.out[:, 0].sum().to(device, non_blocking=True) for d in self._dev.values()]
        if not bad:
            return torch.zeros((), dtype=torch.float32, device=device)
        total = bad[0] if len(bad) == 1 else torch.stack(bad).sum()
        return (total > 0).to(torch.float32)

    def bad_counts(self, device: torch.device) -> torch.Tensor:
        """float64 [len(keys)] on `device`: this step's non-finite count per gradient (no sync)."""
        n = len(self.keys)
        parts = [d.out[:n, 0].to(device, non_blocking=True) for d in self._dev.values()]
        if not parts:
            return torch.zeros(n, dtype=DTYPE, device=device)
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)

    def set_reduced_flag(self, flag: Optional[torch.Tensor]) -> None:
        """The cross-rank flags of this step (guard.CrossRankFlag.reduce: all ranks'
        gradients), copied with the step."""
        self._flag = flag

    def end_step(self, step: int) -> Optional[SentinelPending]:
        """Start the copies of this step's sentinel to host memory; never waits."""
        if self._present is None:
            return None
        copies = []
        for d in self._dev.values():
            host = d.host()
            if d.device.type == "cuda":
                host.copy_(d.out, non_blocking=True)
                ev = d.event()
                ev.record(torch.cuda.current_stream(d.device))
            else:
                host.copy_(d.out)
                ev = None
            copies.append((d, host, ev))
        flag = None
        if self._flag is not None:
            f = self._flag.detach().reshape(-1).to(torch.float32)
            if f.is_cuda:
                # a pinned allocation of its own each step would block the host (cudaHostAlloc)
                pool = self._flag_pool
                h, ev = (pool.pop() if pool and pool[-1][0].shape == f.shape else
                         (torch.empty(f.shape, dtype=torch.float32, pin_memory=True),
                          torch.cuda.Event()))
                h.copy_(f, non_blocking=True)
                ev.record(torch.cuda.current_stream(f.device))
                flag = (h, ev)
            else:
                flag = (f.clone(), None)
        pending = SentinelPending(step, self._present, self._numel, copies, flag,
                                  self.guarded)
        self._present, self._flag, self.guarded = None, None, False
        return pending

    # -- off the hot path ----------------------------------------------------------------------
    def frame(self, p: SentinelPending) -> SentinelFrame:
        n = len(self.keys)
        order, keys = self._in_order()
        if len(p.copies) == 1:   # one device (the usual case): its rows in backward order
            d, host, ev = p.copies[0]
            cols = host.numpy()[:n][order].T.copy()   # sync-ok: the copy has landed
            # the sums below over one device: 0 + x, and max(0, x)
            np.add(cols, 0.0, out=cols)
            np.maximum(cols[1], 0.0, out=cols[1])
            if ev is not None:   # completed: recorded again by a later step
                d.events.append(ev)
            if host.shape == d.out.shape:
                d.pool.append(host)
        else:
            total = np.zeros((n, COLS))
            for d, host, ev in p.copies:
                if ev is not None:
                    d.events.append(ev)
                vals = host.numpy()[:n]   # sync-ok: the copy has landed
                total[:, 0] += vals[:, 0]
                total[:, 1] = np.maximum(total[:, 1], vals[:, 1])
                total[:, 2] += vals[:, 2]
                total[:, 3] += vals[:, 3]
                if host.shape == d.out.shape:
                    d.pool.append(host)
            cols = total[order].T.copy()
        flags = None if p.flag is None else p.flag[0].numpy().copy()   # sync-ok: landed
        code = None if flags is None else float(flags[0])
        if p.flag is not None and p.flag[1] is not None:
            self._flag_pool = self._flag_pool[-3:] + [p.flag]
        present, numel = self._meta_in_order(p.present, p.numel, order)
        f = SentinelFrame(step=p.step, keys=list(keys),
                          nonfinite=cols[0], absmax=cols[1], sumsq=cols[2], present=present,
                          nan=cols[3], numel=numel,
                          ordered=self.order is not None,
                          any_rank_bad=None if code is None else code > 0,
                          bad_rank=int(code) - 1 if code else None,
                          bad_rank_lo=int(RANK_BIG - flags[1]) if code else None,
                          row_ranks=_row_ranks(flags, len(self.keys), order))
        f.skipped = p.guarded and f.tripped
        self._read = self._read[-255:] + [f]
        return f

    def _in_order(self) -> tuple[np.ndarray, list]:
        """The rows' order as an index array and the keys in it, made again only when the order
        or the keys change (indexing with a list converts it on every call, every step)."""
        got = self._ordered
        if got is None or got[0] is not self.order or got[1] is not self.keys:
            order = self.order if self.order is not None else range(len(self.keys))
            idx = np.asarray(list(order), dtype=np.int64)
            got = self._ordered = (self.order, self.keys, idx, [self.keys[i] for i in idx])
        return got[2], got[3]

    def _meta_in_order(self, present: np.ndarray, numel: np.ndarray, order: np.ndarray):
        """present[order], numel[order]; the same arrays again while the step's are the same
        objects (write_again hands the last full write's on) and so is the order (frames only
        read them)."""
        got = self._meta
        if got is None or got[0] is not present or got[1] is not numel or got[2] is not order:
            got = self._meta = (present, numel, order, present[order], numel[order])
        return got[3], got[4]

    def drain_read(self) -> list:
        """The sentinels read since the last call, in step order."""
        out, self._read = self._read, []
        return out

    # -- plans ---------------------------------------------------------------------------------
    def _rows_on(self, device: torch.device) -> _DevSentinel:
        d = self._dev.get(device)
        if d is None or d.out.shape[0] < len(self.keys):
            d = self._dev[device] = _DevSentinel(device, max(1, len(self.keys)))
        return d

    def _build(self, items: list, sig) -> Optional[_Plan]:
        groups: dict = {}
        rest: dict = {}
        launchable = self.ops.sentinel_launchable
        for k, (r, g) in enumerate(items):
            if g.numel() == 0:
                continue
            if launchable is not None and launchable(g, self.ops.name):
                groups.setdefault((g.device, g.dtype), []).append(k)
            else:
                rest.setdefault(g.device, []).append(k)
        launches = []
        for (device, _), ks in groups.items():
            launch = self.ops.sentinel_launch([items[k][1] for k in ks], self._dev[device].out,
                                              [items[k][0] for k in ks])
            launches.append((device, launch, ks))
        self._twin(items, rest)
        return _Plan(sig[0], sig[1], launches, rest) if sig is not None else None

    def _twin(self, items: list, rest: dict) -> None:
        for device, ks in rest.items():
            self._twin_on(device, [items[k][1] for k in ks], [items[k][0] for k in ks])

    def _twin_on(self, device: torch.device, grads: list, rows: list) -> None:
        # CPU gradients are read in numpy (stats/sentinel_cpu.py); backend "torch" asks for
        # the pure-torch twin itself, as traced code does
        out = self._dev[device].out
        if (device.type == "cpu" and self.ops.name != "torch" and not _compiling()
                and all(host_ok(g) for g in grads)):
            sentinel_host(grads, out, rows)
        else:
            sentinel_reference(grads, out, rows)

    @staticmethod
    def _rebind(plan: _Plan, items: list, addrs: tuple) -> bool:
        for _, launch, ks in plan.launches:
            if not launch.rebind([addrs[k] for k in ks]):
                return False
        plan.addrs = addrs
        return True


def _row_ranks(flags, n: int, order: list) -> Optional[np.ndarray]:
    if flags is None or len(flags) != 2 + 2 * n:
        return None
    hi, lo = flags[2:2 + n], flags[2 + n:]
    out = np.stack([np.where(lo > 0, RANK_BIG - lo, -1), hi - 1], 1).astype(np.int64)
    return out[order]


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn and fn())


def _signature(items: list):
    try:
        return (tuple((r, g.numel(), g.stride(), g.dtype, g.device) for r, g in items),
                tuple(g.data_ptr() for _, g in items))
    except (RuntimeError, TypeError):
        return None
