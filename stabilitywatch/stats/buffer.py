"""Device rows for one step, copied to host memory asynchronously and read a step later.

Slots are (module, role) pairs numbered on the host as they first appear. On each device a
float64 [capacity x N_STATS] tensor holds the rows of the step in flight; at the end of the step
the touched rows go to pinned host memory with a non-blocking copy and a CUDA event. A frame is
read only once its event has completed (`poll`), or at `close` (`poll(block=True)`): the
training loop never waits for the GPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..kernels.dispatch import (accumulate, accumulate_each, accumulate_many, batchable,
                                host_scale_of, tileable, viewable)
from .cpu_stage import HostStage
from .derive import derive_many
from .layout import N_STATS, ROW_DTYPE, init_row_tensor
from .sentinel import SentinelFrame
from .sentinel_store import SentinelPending, SentinelStore


log = logging.getLogger("stabilitywatch")

_UNSEEN = 1 << 30  # sequence number of rows written by compiled code (order unknown)


class Phase:
    """Execution order of roles inside a step, for 'where did it first appear'."""
    BATCH = 0
    WEIGHT = 1
    FORWARD = 2
    LOSS = 3
    BACKWARD = 4
    GRAD = 5
    OPTIM = 6


@dataclass
class StatsFrame:
    """The statistics of one step: rows in execution order (phase, then first touch)."""
    step: int
    keys: list[tuple[str, str]]      # (module, role)
    rows: np.ndarray                 # [len(keys), N_STATS] float64
    scales: list[float]
    phases: list[int]
    rank: int = 0
    world_size: int = 1
    # every parameter gradient's non-finite count, absmax and sum of squares, in backward
    # order (stats/sentinel.py); None when no gradient was read this step
    sentinel: Optional[SentinelFrame] = None
    _derived: dict = field(default_factory=dict, repr=False)

    def derived(self, i: int) -> dict[str, float]:
        if not self._derived:  # all rows at once: cheaper than one row at a time
            self._derived.update(enumerate(derive_many(self.rows, self.scales)))
        return self._derived[i]

    def column(self, stat: str) -> list:
        """One derived value of every row, in row order (a shared list: do not modify)."""
        if not self.keys:
            return []
        return self.derived(0).column(stat)

    def index(self, module: str, role: str) -> Optional[int]:
        try:
            return self.keys.index((module, role))
        except ValueError:
            return None


class _DeviceRows:
    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        # one extra column: the scale of tensor-valued scales (FP8 recipes), read with the rows
        self.rows = _static(init_row_tensor(device, capacity))
        self.views = self.rows.unbind(0)  # one view per row, made once (indexing costs ~3 us)
        self.scale = torch.ones(capacity, 1, dtype=ROW_DTYPE, device=device)
        self.init = init_row_tensor(device, capacity)
        self.pinned_pool: list[torch.Tensor] = []
        # rows [lo, hi) may hold writes since their last reset; the rest hold the identity row
        self.dirty = (0, 0)

    def mark(self, lo: int, hi: int) -> None:
        self.dirty = _union(self.dirty, (lo, hi))

    def reset(self, every_row: bool = False) -> None:
        lo, hi = (0, self.rows.shape[0]) if every_row else self.dirty
        if hi > lo:
            self.rows[lo:hi].copy_(self.init[lo:hi])
        self.dirty = (0, 0)

    def grow(self, capacity: int) -> None:
        # keep rows already written this step (device copy, no sync)
        rows = _static(init_row_tensor(self.device, capacity))
        rows[: self.rows.shape[0]].copy_(self.rows)
        scale = torch.ones(capacity, 1, dtype=ROW_DTYPE, device=self.device)
        scale[: self.scale.shape[0]].copy_(self.scale)
        self.rows, self.scale = rows, scale
        self.views = rows.unbind(0)
        self.init = init_row_tensor(self.device, capacity)
        self.pinned_pool.clear()

    def host_buffer(self) -> torch.Tensor:
        if self.pinned_pool:
            return self.pinned_pool.pop()
        pin = self.device.type == "cuda"
        shape = (self.rows.shape[0], self.rows.shape[1] + 1)
        return torch.empty(shape, dtype=ROW_DTYPE, pin_memory=pin)


def _union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    # the smallest span holding both spans (an empty one, lo >= hi, adds nothing)
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


@dataclass
class _ManyPlan:
    """What add_many did for one list of tensors, to do again without host work per tensor
    while tensors of the same kinds (shape, dtype, device, rows) come back: the taps over
    parameters, gradients and optimizer state pass such a list every sampled step. Gradients
    set to None between steps come back at other addresses: the launches then only take the
    new addresses (`rebind`). No tensor references (they would keep freed gradients alive)."""
    shape: tuple
    addrs: tuple
    slots: list[int]
    launches: list                    # (device, kept launch, [(item index, element offset)])
    singles: list[tuple[int, int]]    # (item index, slot): their own launch each
    span: tuple[int, int]             # the rows the launches write lie in [lo, hi)


def _many_sig(items: list) -> Optional[tuple[tuple, tuple]]:
    # (the kinds of the items, their addresses); None: not cacheable (a tensor-valued scale:
    # its value is on the device, and reading it would sync)
    if any(isinstance(s, torch.Tensor) for _, _, _, s in items):
        return None
    try:
        return (tuple((t.numel(), t.stride(), t.dtype, t.device, m, r, float(s))
                      for t, m, r, s in items),
                tuple(t.data_ptr() for t, _, _, _ in items))
    except (TypeError, RuntimeError, ValueError):
        return None


def _rebind(plan: _ManyPlan, items: list, addrs: tuple) -> bool:
    # the plan's launches on the items' new addresses; False: a launch cannot take them
    for _, launch, src in plan.launches:
        if not launch.rebind([addrs[k] + off * items[k][0].element_size() for k, off in src]):
            return False
    plan.addrs = addrs
    return True


@dataclass
class _Pending:
    step: int
    touched: list[tuple[int, int, int]]                # (phase, seq, slot)
    copies: list[tuple[_DeviceRows, torch.Tensor, Optional[object]]]
    sentinel: Optional[SentinelPending] = None


class StatsBuffer:
    def __init__(self, backend: str = "auto", capacity: int = 64):
        self.backend = backend
        self.keys: list[tuple[str, str]] = []
        self.scales: list[float] = []
        self.slot_of: dict[tuple[str, str], int] = {}
        self.device_of: list[Optional[torch.device]] = []
        self.phase_of: list[int] = []
        self.tensor_scaled: set[int] = set()
        self._capacity = capacity
        self._dev: dict[torch.device, _DeviceRows] = {}
        self._touched: dict[int, tuple[int, int]] = {}
        # set when compiled code may have written rows the host did not see (see traced_target)
        self._untracked = False
        self._pending: list[_Pending] = []
        self._step: Optional[int] = None
        self._plans: dict = {}            # (phase, overwrite) -> _ManyPlan
        self.sentinel = SentinelStore(backend)
        self._stage = HostStage()         # small CPU tensors of the step, read together
        self._recent: dict[int, SentinelFrame] = {}   # step -> sentinel of recently read frames

    # -- hot path -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._step = step
        self._touched = {}
        self._stage.clear()   # writes outside a step: their rows are reset below
        # Only the rows written since their last reset (every write marks its device's rows, in
        # or outside a step): an unsampled step writes one or two of the ~600, and resetting
        # all took a device copy per step. Compiled code writes rows unseen: all of them.
        for d in self._dev.values():
            d.reset(every_row=self._untracked)

    def add(self, t: torch.Tensor, module: str, role: str, phase: int,
            scale: float = 1.0, overwrite: bool = False) -> None:
        """Merge t's statistics into the (module, role) row of this step. No host sync."""
        slot, row = self._prepare(t, module, role, phase, scale, overwrite)
        try:
            rows = self._dev[t.device].rows
            s = host_scale_of(t, rows, scale, self.backend) if t.device.type == "cpu" else None
            if s is None or not self._stage.put(t, slot, s, self._rows_of):
                accumulate(t, row, scale, self.backend)
        except BaseException:
            self._drop([slot])
            raise

    def add_many(self, items: list, phase: int, overwrite: bool = False) -> None:
        """add() for each (tensor, module, role, scale) of items; the tensors at scale 1 that the
        kernel reads share one launch per device and dtype (kernels/stats_multi.py), and the
        large float32/bf16/fp16 ones another (kernels/tile_multi.py).
        The next call with the same tensors in the same order repeats those launches."""
        writing: list[int] = []   # the slots this call has begun to write
        try:
            self._add_many(items, phase, overwrite, writing)
        except BaseException:
            # those rows hold partial sums now: none of them is read this step
            self._plans.pop((phase, overwrite), None)
            self._drop(writing)
            raise

    def _add_many(self, items: list, phase: int, overwrite: bool, writing: list) -> None:
        sig = _many_sig(items)
        plan = self._plans.get((phase, overwrite))
        if (sig is not None and plan is not None and plan.shape == sig[0]
                and not any(s in self._touched for s in plan.slots)
                and (plan.addrs == sig[1] or _rebind(plan, items, sig[1]))):
            writing += plan.slots
            n = len(self._touched)
            for k, slot in enumerate(plan.slots):
                self._touched[slot] = (phase, n + k)
            for device, launch, _ in plan.launches:
                self._dev[device].mark(*plan.span)
                launch.run(self._dev[device].rows)
            for k, slot in plan.singles:
                self._dev[items[k][0].device].mark(slot, slot + 1)
            self._accumulate_singles(items, plan.singles)
            return
        if overwrite and len({(m, r) for _, m, r, _ in items}) < len(items):
            # a row written twice: the last write wins, as with add() one after the other (a
            # kept plan never has a row twice)
            for t, module, role, scale in items:
                self.add(t, module, role, phase, scale, overwrite)   # drops its own row
            return
        groups: dict = {}
        slots, singles = [], []
        for k, (t, module, role, scale) in enumerate(items):
            slot, row = self._prepare(t, module, role, phase, scale, overwrite)
            writing.append(slot)
            slots.append(slot)
            if batchable(t, scale, self.backend) or tileable(t, scale, self.backend):
                if not viewable(t):  # the table would hold a temporary copy's address
                    sig = None
                ts, ss, ks = groups.setdefault(t.device, ([], [], []))
                ts.append(t)
                ss.append(slot)
                ks.append(k)
            else:
                singles.append((k, slot))
        self._accumulate_singles(items, singles)
        launches = []
        for device, (ts, ss, ks) in groups.items():
            # after every _prepare: rows may have grown (a new tensor) while preparing
            launches += [(device, lk, [(ks[i], off) for i, off in src]) for lk, src
                         in accumulate_many(ts, self._dev[device].rows, ss)]
        if sig is not None and len(set(slots)) == len(slots):
            span = (min(slots), max(slots) + 1) if slots else (0, 0)
            self._plans[(phase, overwrite)] = _ManyPlan(*sig, slots, launches, singles, span)

    def _accumulate_singles(self, items: list, singles: list) -> None:
        # one call for all: CPU tensors share the CPU path's passes (kernels/dispatch.py)
        accumulate_each([(items[k][0], self._dev[items[k][0].device].rows, slot, items[k][3])
                         for k, slot in singles], self.backend)

    def _prepare(self, t: torch.Tensor, module: str, role: str, phase: int, scale,
                 overwrite: bool) -> tuple[int, torch.Tensor]:
        # the slot of (module, role), made on first sight; its row made ready for this write.
        # What can fail (a bad scale, an allocation) runs before the step's bookkeeping changes:
        # a failed call leaves no slot half-made and no row marked as written.
        key = (module, role)
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._new_slot(key, scale, phase)
        dev = self._rows_on(t.device)
        if isinstance(scale, torch.Tensor):  # the value is known on the device only
            dev.scale[slot].copy_(scale.detach().reshape(1))
            self.tensor_scaled.add(slot)
        dev.mark(slot, slot + 1)
        if self.device_of[slot] is None:
            self.device_of[slot] = t.device
        row = dev.views[slot]
        if slot not in self._touched:
            self._touched[slot] = (phase, len(self._touched))
        elif overwrite:  # begin_step reset every row: only a second write this step needs this
            self._flush_stage()
            row.copy_(dev.init[slot])
        return slot, row

    def _drop(self, slots) -> None:
        """Forget this step's writes to `slots` (a write to them failed: what the rows hold is
        unknown): the rows go back to the identity row and are not read this step."""
        self._flush_stage()
        for slot in set(slots):
            self._touched.pop(slot, None)
            for dev in self._dev.values():
                if slot < dev.rows.shape[0]:
                    dev.mark(slot, slot + 1)
                    dev.views[slot].copy_(dev.init[slot])

    def end_step(self) -> None:
        """Start the copies of this step's rows to host memory; never waits."""
        self._flush_stage()
        sent = self.sentinel.end_step(self._step) if self._step is not None else None
        if self._step is None or not (self._touched or self._untracked or sent):
            self._step = None
            return
        touched = sorted((ph, seq, slot) for slot, (ph, seq) in self._touched.items())
        if self._untracked:  # compiled code writes rows without host bookkeeping: read them all
            seen = {slot for _, _, slot in touched}
            touched += [(self.phase_of[s], _UNSEEN, s) for s in range(len(self.keys))
                        if s not in seen and self.device_of[s] is not None]
            touched.sort()
        spans = self._spans(self._touched)
        copies = []
        for dev in self._dev.values():
            host = dev.host_buffer()
            # the touched rows' span only: an unsampled step copies the loss row, not ~600
            lo, hi = (0, dev.rows.shape[0]) if self._untracked else spans.get(dev.device, (0, 0))
            if hi <= lo:
                copies.append((dev, host, None))
                continue
            both = torch.cat([dev.rows[lo:hi], dev.scale[lo:hi]], 1)
            if dev.device.type == "cuda":
                host[lo:hi].copy_(both, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev.device))
            else:
                host[lo:hi].copy_(both)
                ev = None
            copies.append((dev, host, ev))
        self._pending.append(_Pending(self._step, touched, copies, sent))
        self._step = None
        self._touched = {}

    # -- off the hot path -----------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Steps ended whose frames have not been read yet."""
        return len(self._pending)

    def last_pending(self):
        """The latest step ended and not read yet (its copies and events), or None."""
        return self._pending[-1] if self._pending else None

    def poll(self, block: bool = False, rank: int = 0, world_size: int = 1,
             limit: Optional[int] = None) -> list[StatsFrame]:
        """Frames whose copies have landed, oldest first (all of them when block=True); at most
        `limit` frames when given (the distributed flush reads exactly the steps it agreed on)."""
        frames = []
        while self._pending and (limit is None or len(frames) < limit):
            p = self._pending[0]
            if not block and not (all(ev is None or ev.query() for _, _, ev in p.copies)
                                  and (p.sentinel is None or p.sentinel.ready())):
                break
            for _, _, ev in p.copies:
                if ev is not None:
                    ev.synchronize()
            if p.sentinel is not None:
                p.sentinel.wait()
            self._pending.pop(0)
            frames.append(self._frame(p, rank, world_size))
        return frames

    def _frame(self, p: _Pending, rank: int, world_size: int) -> StatsFrame:
        host_of = {dev.device: host.numpy() for dev, host, _ in p.copies}  # sync-ok: copy done
        keep, rows, scales = [], [], []
        for ph, seq, slot in p.touched:
            host = host_of[self.device_of[slot]]
            if seq == _UNSEEN and host[slot, 0] == 0:  # a slot compiled code did not write
                continue
            keep.append((ph, slot))
            rows.append(host[slot, :N_STATS])
            scales.append(float(host[slot, N_STATS]) if slot in self.tensor_scaled
                          else self.scales[slot])
        for dev, host, _ in p.copies:
            if host.shape[0] == dev.rows.shape[0]:
                dev.pinned_pool.append(host)
        table = np.array(rows, dtype=np.float64).reshape(len(rows), N_STATS)
        sent = self.sentinel.frame(p.sentinel) if p.sentinel is not None else None
        if sent is not None:
            self._recent[p.step] = sent
            while len(self._recent) > 64:
                self._recent.pop(next(iter(self._recent)))
        return StatsFrame(step=p.step, keys=[self.keys[s] for _, s in keep], rows=table,
                          scales=scales, phases=[ph for ph, _ in keep], rank=rank,
                          world_size=world_size, sentinel=sent)

    def sentinel_of(self, step: int) -> Optional[SentinelFrame]:
        """The sentinel of a recently read step (frames merged across ranks are built anew and
        carry none: the monitor finds this rank's here)."""
        return self._recent.get(step)

    def _spans(self, touched) -> dict:
        # device -> (lo, hi): the span of the given slots' rows on each device
        spans: dict = {}
        for slot in touched:
            d = self.device_of[slot]
            lo, hi = spans.get(d, (slot, slot + 1))
            spans[d] = (min(lo, slot), max(hi, slot + 1))
        return spans

    def traced_target(self, module: str, role: str, device: torch.device):
        """(rows, slot, scale) for a record made from compiled code, or None when the slot or
        the device's rows do not exist yet (the eager path then creates them)."""
        slot = self.slot_of.get((module, role))
        dev = self._dev.get(device)
        if slot is None or dev is None or self.device_of[slot] != device:
            return None
        return dev.rows, slot, self.scales[slot]

    def _new_slot(self, key: tuple[str, str], scale: float, phase: int = 0) -> int:
        # every step that can fail (the scale's value, growing the rows) comes before the slot
        # enters any of the per-slot lists, which must stay the same length
        value = 1.0 if isinstance(scale, torch.Tensor) else float(scale)
        slot = len(self.keys)
        if slot >= self._capacity:
            capacity = max(2 * self._capacity, slot + 1)
            for d in self._dev.values():
                if d.rows.shape[0] < capacity:
                    d.grow(capacity)
            self._capacity = capacity
        self.phase_of.append(phase)
        self.keys.append(key)
        self.scales.append(value)
        self.device_of.append(None)
        self.slot_of[key] = slot
        return slot

    def _rows_of(self, device: torch.device) -> torch.Tensor:
        return self._dev[device].rows

    def _flush_stage(self) -> None:
        # the held CPU tensors' rows; a failure drops those rows from the step (as a failed
        # add() does) and the step goes on
        if not self._stage.held:
            return
        slots = self._stage.slots()
        try:
            self._stage.flush(self._rows_of)
        except Exception as e:
            log.warning("stabilitywatch: the statistics of %d CPU tensors failed (%s: %s); their "
                        "rows are left out of this step", len(slots), type(e).__name__, e)
            self._stage.clear()
            self._drop(slots)

    def _rows_on(self, device: torch.device) -> _DeviceRows:
        d = self._dev.get(device)
        if d is None:
            d = self._dev[device] = _DeviceRows(device, self._capacity)
            if self._step is not None:
                d.rows.copy_(d.init)
        return d
