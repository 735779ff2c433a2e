"""Device rows for one step, copied to host memory asynchronously and read a step later.

Slots are (module, role) pairs numbered on the host as they first appear (slots.py). On each
device a float64 [capacity x N_STATS] tensor holds the rows of the step in flight
(device_rows.py); at the end of the step the touched rows go to pinned host memory with a
non-blocking copy and a CUDA event (staging.py). A frame is read only once its event has
completed (`poll`), or at `close` (`poll(block=True)`): the training loop never waits for the
GPU. Lists of tensors that come back every step repeat their launches (plans.py). The rows are
written by the `RowBackend` the buffer is given (backend.py): stats/ does not import kernels/.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .backend import TORCH, RowBackend
from .cpu import cpu_rows, host_view, merge_host
from .cpu_stage import HostStage
from .device_rows import DeviceRows
from .frame import Phase, StatsFrame
from .held import HOLD_MAX_BYTES, Held
from .plans import ManyPlan, many_sig, rebind
from .sentinel import SentinelFrame
from .sentinel_store import SentinelStore
from .slots import SlotTable
from .staging import UNSEEN, Pending, read_frame, start_copies

__all__ = ["Phase", "StatsBuffer", "StatsFrame"]

log = logging.getLogger("stabilitywatch")

# the phases of the hooks' records, which may be held (held.py)
_HELD_PHASES = frozenset({Phase.FORWARD, Phase.BACKWARD})


class StatsBuffer:
    def __init__(self, backend: RowBackend = TORCH, capacity: int = 64):
        if not isinstance(backend, RowBackend):
            raise TypeError("StatsBuffer: backend must be a stats.backend.RowBackend "
                            "(stabilitywatch.kernels.backend.kernel_backend(name) gives one), "
                            f"got {type(backend).__name__}")
        self.ops = backend
        self.backend = backend.name
        self._accumulate = backend.accumulate   # the hot path: one lookup less per call
        self.slots = SlotTable(capacity)
        # the slot table's lists, read in place on the hot path
        self.keys, self.scales = self.slots.keys, self.slots.scales
        self.slot_of, self.device_of = self.slots.slot_of, self.slots.device_of
        self.phase_of, self.tensor_scaled = self.slots.phase_of, self.slots.tensor_scaled
        self._dev: dict[torch.device, DeviceRows] = {}
        self._touched: dict[int, tuple[int, int]] = {}
        # set during a step in which compiled code may have written rows the host did not see
        # (mark_untracked): that step reads every row, and the next one resets them all
        self._untracked = False
        self._pending: list[Pending] = []
        self._step: Optional[int] = None
        self._plans: dict = {}            # (phase, overwrite) -> ManyPlan
        self.sentinel = SentinelStore(backend)
        self._stage = HostStage()         # small CPU tensors of the step, read together
        self._recent: dict[int, SentinelFrame] = {}   # step -> sentinel of recently read frames
        # the hooks' records on these devices wait to share launches (held.py); () = none
        self.hold_on: tuple = ("cuda",)
        self._held = Held()
        self._chunks: dict[int, int] = {}   # phase -> launches of held tensors this step

    # -- hot path -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._step = step
        self._touched = {}
        self._held.clear()    # a step that never ended: its rows are reset below
        self._chunks = {}
        self._stage.clear()   # writes outside a step: their rows are reset below
        # Only the rows written since their last reset (every write marks its device's rows, in
        # or outside a step): an unsampled step writes one or two of the ~600, and resetting
        # all took a device copy per step. Compiled code writes rows unseen: all of them.
        for d in self._dev.values():
            d.reset(every_row=self._untracked)
        self._untracked = False

    def add(self, t: torch.Tensor, module: str, role: str, phase: int,
            scale: float = 1.0, overwrite: bool = False) -> None:
        """Merge t's statistics into the (module, role) row of this step. No host sync. A
        forward or backward hook's tensor on a GPU may be held to share a later launch."""
        device = t.device
        if (phase in _HELD_PHASES and device.type in self.hold_on and not overwrite
                and type(scale) is float and scale == 1.0 and self._step is not None
                and self._hold(t, module, role, phase)):
            return
        if self._held.items:   # what was held is launched first: the rows see writes in order
            self._flush_held()
        slot, row = self._prepare(t, module, role, phase, scale, overwrite, device)
        try:
            ops = self.ops
            s = (ops.host_scale_of(t, self._dev[device].rows, scale, self.backend)
                 if device.type == "cpu" and ops.host_scale_of is not None else None)
            if s is None:
                self._accumulate(t, row, scale, self.backend)
            elif not self._stage.put(t, slot, s, self.rows_of) and t.numel():
                # the CPU path, as the backend would take it (host_scale_of said so)
                merge_host(host_view(row).reshape(1, -1), cpu_rows([t], [s]))
        except BaseException:
            self._drop([slot])
            raise

    def add_many(self, items: list, phase: int, overwrite: bool = False,
                 key: "tuple | None" = None) -> None:
        """add() for each (tensor, module, role, scale) of items; the tensors at scale 1 that the
        kernel reads share one launch per device and dtype (kernels/stats_multi.py), and the
        large float32/bf16/fp16 ones another (kernels/tile_multi.py).
        The next call with the same tensors in the same order under the same `key` (by default
        (phase, overwrite)) repeats those launches."""
        if self._held.items:
            self._flush_held()
        writing: list[int] = []   # the slots this call has begun to write
        key = (phase, overwrite) if key is None else key
        try:
            self._add_many(items, phase, overwrite, writing, key)
        except BaseException:
            # those rows hold partial sums now: none of them is read this step
            self._plans.pop(key, None)
            self._drop(writing)
            raise

    def mark_untracked(self) -> None:
        """Compiled code writes rows this step (the custom op on traced_slot's rows) without the
        host's bookkeeping: the step reads every row and the next one resets them all."""
        self._untracked = True

    def _add_many(self, items: list, phase: int, overwrite: bool, writing: list,
                  key: tuple) -> None:
        ops = self.ops
        sig = many_sig(items)
        plan = self._plans.get(key)
        touched = self._touched
        if (sig is not None and plan is not None and plan.shape == sig[0]
                and touched.keys().isdisjoint(plan.slots)
                and (plan.addrs == sig[1] or rebind(plan, items, sig[1]))):
            writing += plan.slots
            n = len(touched)
            for k, slot in enumerate(plan.slots):
                touched[slot] = (phase, n + k)
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
            if ops.batchable(t, scale, self.backend) or ops.tileable(t, scale, self.backend):
                if not ops.viewable(t):  # the table would hold a temporary copy's address
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
                         in ops.accumulate_many(ts, self._dev[device].rows, ss)]
        if sig is not None and len(set(slots)) == len(slots):
            span = (min(slots), max(slots) + 1) if slots else (0, 0)
            self._plans[key] = ManyPlan(*sig, slots, launches, singles, span)

    def _hold(self, t: torch.Tensor, module: str, role: str, phase: int) -> bool:
        held = self._held
        nbytes = t.numel() * t.element_size()
        if not 0 < nbytes <= HOLD_MAX_BYTES or (module, role) in held.immediate:
            return False
        if not held.fits(t, phase):
            self._flush_held()
        if held.put(t, module, role, phase, nbytes):
            self._flush_held()
        return True

    def _flush_held(self) -> None:
        """Launch what is held; never raises: a failure leaves those rows out of the step and
        turns holding off, with one warning each."""
        kept, moved, phase = self._held.take()
        for _, module, role, _ in moved:
            self._held.immediate.add((module, role))
            log.warning("stabilitywatch: %s %s was written in place after its hook: not read this "
                        "step, read at its hook from now on", module or "<model>", role)
        if not kept:
            return
        n = self._chunks.get(phase, 0)
        self._chunks[phase] = n + 1
        try:
            self.add_many(kept, phase, False, ("held", phase, n))
        except Exception as e:
            self.hold_on = ()
            log.warning("stabilitywatch: the statistics of %d tensors read together failed (%s: %s);"
                        " their rows are left out of this step, and each tensor is read at its "
                        "hook from now on", len(kept), type(e).__name__, e)

    def _accumulate_singles(self, items: list, singles: list) -> None:
        # one call for all: CPU tensors share the CPU path's passes (stats/cpu.py), the small
        # ones in the stage with the step's other small CPU tensors
        ops = self.ops
        if singles and ops.host_scale_of is not None:
            held, rest = [], []
            for k, slot in singles:
                t, _, _, scale = items[k]
                s = (ops.host_scale_of(t, self._dev[t.device].rows, scale, self.backend)
                     if t.device.type == "cpu" else None)
                if s is None:
                    rest.append((k, slot))
                else:
                    held.append((k, slot, s))
            if held:
                left = self._stage.put_many([(items[k][0], slot, s) for k, slot, s in held],
                                            self.rows_of)
                rest += [held[i][:2] for i in left]
            singles = rest
        if ops.accumulate_each is None:
            for k, slot in singles:
                t, _, _, scale = items[k]
                ops.accumulate(t, self._dev[t.device].views[slot], scale, self.backend)
            return
        ops.accumulate_each([(items[k][0], self._dev[items[k][0].device].rows, slot, items[k][3])
                             for k, slot in singles], self.backend)

    def _prepare(self, t: torch.Tensor, module: str, role: str, phase: int, scale,
                 overwrite: bool, device: "torch.device | None" = None
                 ) -> tuple[int, torch.Tensor]:
        # the slot of (module, role), made on first sight; its row made ready for this write.
        # What can fail (a bad scale, an allocation) runs before the step's bookkeeping changes:
        # a failed call leaves no slot half-made and no row marked as written.
        key = (module, role)
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._new_slot(key, scale, phase)
        if device is None:
            device = t.device
        dev = self._dev.get(device)
        if dev is None:
            dev = self._rows_on(device)
        if isinstance(scale, torch.Tensor):  # the value is known on the device only
            dev.scale[slot].copy_(scale.detach().reshape(1))
            self.tensor_scaled.add(slot)
        lo, hi = dev.dirty
        if not lo <= slot < hi:   # DeviceRows.mark, inline: rows come in slot order mostly
            dev.dirty = (min(lo, slot), max(hi, slot + 1)) if lo < hi else (slot, slot + 1)
        if self.device_of[slot] is None:
            self.device_of[slot] = device
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
                    dev.reset_row(slot)

    def end_step(self) -> None:
        """Start the copies of this step's rows to host memory; never waits."""
        if self._held.items:
            self._flush_held()
        self._flush_stage()
        sent = self.sentinel.end_step(self._step) if self._step is not None else None
        if self._step is None or not (self._touched or self._untracked or sent):
            self._step = None
            return
        touched = sorted([(ph, seq, slot) for slot, (ph, seq) in self._touched.items()])
        if self._untracked:  # compiled code writes rows without host bookkeeping: read them all
            seen = {slot for _, _, slot in touched}
            touched += [(self.phase_of[s], UNSEEN, s) for s in range(len(self.keys))
                        if s not in seen and self.device_of[s] is not None]
            touched.sort()
        # the touched rows' span only: an unsampled step copies the loss row, not ~600
        spans = None if self._untracked else self.slots.spans(self._touched)
        copies = start_copies(self._dev.values(), spans)
        self._pending.append(Pending(self._step, touched, copies, sent))
        self._step = None
        self._touched = {}

    # -- off the hot path -----------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Steps ended whose frames have not been read yet."""
        return len(self._pending)

    @property
    def untracked(self) -> bool:
        """True when compiled code may have written rows without the host's bookkeeping."""
        return self._untracked

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
            if not block and not p.ready():
                break
            if block:   # a step whose events all completed needs no wait call
                p.wait()
            self._pending.pop(0)
            sent = self.sentinel.frame(p.sentinel) if p.sentinel is not None else None
            if sent is not None:
                self._recent[p.step] = sent
                while len(self._recent) > 64:
                    self._recent.pop(next(iter(self._recent)))
            frames.append(read_frame(p, self.slots, sent, rank, world_size))
        return frames

    def sentinel_of(self, step: int) -> Optional[SentinelFrame]:
        """The sentinel of a recently read step (frames merged across ranks are built anew and
        carry none: the monitor finds this rank's here)."""
        return self._recent.get(step)

    def traced_slot(self, module: str, role: str, device: torch.device, scale: float,
                    phase: int) -> Optional[tuple[int, float]]:
        """(slot, scale) of (module, role) for a record made from compiled code, the slot and
        the device's rows made on first sight; None when the slot's rows live on another
        device. Runs on the host while torch.compile traces (the answer is a constant of the
        graph): compiled code never depends on the slot table, so it is not guarded on it.
        None as well for a new slot when the rows are full (they cannot grow while a graph that
        holds them is traced)."""
        slot = self.slot_of.get((module, role))
        if slot is None:
            if self.slots.grown_capacity() is not None:
                # the graph traced so far holds the rows tensor that growing would replace
                return None
            slot = self._new_slot((module, role), scale, phase)
        self._rows_on(device)
        if self.device_of[slot] is None:
            self.device_of[slot] = device
        if self.device_of[slot] != device:
            return None
        return slot, self.scales[slot]

    def _new_slot(self, key: tuple[str, str], scale, phase: int = 0) -> int:
        # every step that can fail (the scale's value, growing the rows) comes before the slot
        # enters the table
        if not isinstance(scale, torch.Tensor):
            float(scale)
        capacity = self.slots.grown_capacity()
        if capacity is not None:
            for d in self._dev.values():
                if d.rows.shape[0] < capacity:
                    d.grow(capacity)
            self.slots.capacity = capacity
        return self.slots.add(key, scale, phase)

    def rows_of(self, device: torch.device) -> torch.Tensor:
        """The rows of `device` (compiled code asks for them after traced_slot made them)."""
        return self._dev[device].rows

    def _flush_stage(self) -> None:
        # the held CPU tensors' rows; a failure drops those rows from the step (as a failed
        # add() does) and the step goes on
        if not self._stage.held:
            return
        slots = self._stage.slots()
        try:
            self._stage.flush(self.rows_of)
        except Exception as e:
            log.warning("stabilitywatch: the statistics of %d CPU tensors failed (%s: %s); their "
                        "rows are left out of this step", len(slots), type(e).__name__, e)
            self._stage.clear()
            self._drop(slots)

    def _rows_on(self, device: torch.device) -> DeviceRows:
        d = self._dev.get(device)
        if d is None:
            d = self._dev[device] = DeviceRows(device, self.slots.capacity)
            if self._step is not None:
                d.rows.copy_(d.init)
        return d
