"""Start-of-step state, kept until the step's statistics have been read.

Frames are read on the host one step late (CUDA) or at the end of the step (CPU); by then the
optimizer has updated the weights. So on steps that may be captured, the state as the step's
forward sees it is copied at step start into one slot of a small ring of preallocated buffers:
parameters and buffers, per-element optimizer state, RNG states (Python, NumPy, torch CPU and
CUDA) and the batch (held by reference). A slot is released once its frame has been processed.

Hot path: `copy_(..., non_blocking=True)`, no `.item()`, no host sync. A device ring is filled
on the current stream (ordered before the optimizer step that follows). A pinned-host ring is
filled on a side stream, so that the device-to-host copy (~35 ms for GPT-2 small's 1.9 GB)
overlaps the forward and backward instead of adding to the step: an optimizer step pre-hook makes
the current stream wait for it (an event, no host sync) before the weights and optimizer state
change, and module buffers (BatchNorm statistics change during the forward) are still copied on
the current stream. The side-stream copies go through a staging buffer in a few large copies
(staging.py): one copy per tensor cost ~7 ms of host time per snapshot. Buffers are allocated on the first snapshot and again only when the set of
tensors changes (the optimizer creates its state on the first step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from .policy import SnapshotTarget
from .rng import RngStates
from .staging import CHUNK, Gather, HostBuffers

log = logging.getLogger("stabilitywatch")


@dataclass
class Slot:
    """One snapshot: buffers are reused from step to step; `step` is None while free."""
    sig: tuple = ()
    model: dict[str, torch.Tensor] = field(default_factory=dict)    # name -> copy
    optim: dict[str, torch.Tensor] = field(default_factory=dict)    # "<index>.<state>" -> copy
    step: Optional[int] = None
    seq: int = -1
    optim_meta: Optional[dict] = None   # param groups (by parameter name), non-tensor state
    rng: dict = field(default_factory=dict)
    batch: Any = None                   # by reference: the loop must not modify it in place
    ready: Any = None                   # CUDA event: the side-stream copy into host memory is done
    host: Optional[HostBuffers] = None  # pinned ring: model and optim are views of its buffers
    gather: Optional[Gather] = None     # its copy plan from the current tensors
    _nbytes: Optional[tuple] = None     # (sig, bytes of model and optim) for nbytes

    @property
    def nbytes(self) -> int:
        # the buffers change only with the signature (Snapshotter._allocate): counted once each
        got = self._nbytes
        if got is None or got[0] is not self.sig:
            got = self._nbytes = (self.sig, sum(t.numel() * t.element_size()
                                                for d in (self.model, self.optim)
                                                for t in d.values()))
        return got[1]


def _model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # tied parameters appear once (named_parameters de-duplicates); restore uses the same names
    out = [(n, p.detach()) for n, p in model.named_parameters()]
    out += [(n, b) for n, b in model.named_buffers() if isinstance(b, torch.Tensor)]
    return out


def _optim_tensors(opt: Optional[torch.optim.Optimizer], names: dict[int, str]):
    """(tensors, meta): state tensors keyed "<flat index>.<state>" as in opt.state_dict(), and
    the JSON-able rest (param groups with parameter names, non-tensor state values)."""
    if opt is None:
        return [], None
    tensors, groups, other = [], [], {}
    i = 0
    for g in opt.param_groups:
        hyper = {k: _plain(v) for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [names.get(id(p), f"<unnamed {i + j}>")
                                           for j, p in enumerate(g["params"])]})
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors.append((f"{i}.{k}", v.detach()))
                else:
                    other[f"{i}.{k}"] = _plain(v)
            i += 1
    return tensors, {"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                     "param_groups": groups, "other_state": other}


def _trained(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point parameters the optimizer updates (those that will get state)."""
    return [p for g in opt.param_groups for p in g["params"]
            if p.requires_grad and p.is_floating_point()]


def _plain(v: Any) -> Any:
    """A JSON-able copy of an optimizer hyper-parameter (lr may be a tensor; betas a tuple)."""
    if isinstance(v, torch.Tensor):  # a device copy, turned into numbers when written (no sync)
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


class Snapshotter:
    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 ring: int = 2, target: SnapshotTarget = SnapshotTarget.AUTO):
        self.model, self.optimizer = model, optimizer
        self.target = target
        self.slots = [Slot() for _ in range(ring)]
        self.skipped = 0          # snapshots not taken because every slot was still held
        self.disabled = False
        self._rng = RngStates()
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._buffer_names = {n for n, _ in model.named_buffers()}
        self._streams: dict[torch.device, Any] = {}
        self._staging: dict[torch.device, torch.Tensor] = {}
        self._waits: list[tuple[torch.device, Any]] = []   # copies the optimizer step waits for
        self._stepped = False     # an optimizer step has run: its state is what it will be
        self._hook = (optimizer.register_step_pre_hook(self._before_optimizer_step)
                      if optimizer is not None else None)

    def close(self) -> None:
        """Detach the optimizer hook and free the ring and the staging buffer (a closed monitor
        the user keeps, to read its alerts, must not hold copies of the model)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._waits.clear()
        self._release_all()

    # -- hot path ------------------------------------------------------------------------------
    def take(self, step: int, batch: Any, seq: int) -> Optional[Slot]:
        """Copy the current state into a free slot; None when every slot is held (the oldest
        steps' statistics are not read yet) or snapshots are off."""
        if self.disabled:
            return None
        slot = next((s for s in self.slots if s.step is None), None)
        if slot is None:
            self.skipped += 1
            return None
        mt = _model_tensors(self.model)
        ot, meta = _optim_tensors(self.optimizer, self._names)
        sig = tuple((n, t.shape, t.dtype, t.device) for n, t in mt + ot)
        try:
            if sig != slot.sig:
                self._allocate(slot, sig, mt, ot)
            slot.ready = self._fill(slot, mt, ot)
        except Exception as e:  # out of memory, odd tensors: no snapshots, training goes on
            self.disabled = True
            self._release_all()
            log.warning("stabilitywatch: start-of-step snapshots switched off (%s: %s); alerts "
                        "are still recorded, without captures", type(e).__name__, e)
            return None
        # param groups can change between steps (LR schedules): copy their values now
        slot.optim_meta = meta
        slot.rng = self._rng.read()
        slot.batch, slot.step, slot.seq = batch, step, seq
        return slot

    def _fill(self, slot: Slot, mt, ot) -> Any:
        dst = list(slot.model.values()) + list(slot.optim.values())
        src = [t for _, t in mt + ot]
        devs = {t.device for t in src if t.is_cuda}
        on_host = any(not d.is_cuda for d, s in zip(dst, src) if s.is_cuda)
        if not (on_host and self._hook is not None and len(devs) == 1 and slot.host is not None):
            _copy(dst, src)
            return None
        dev = devs.pop()
        main = torch.cuda.current_stream(dev)
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(dev)
        keep = [i for i, (n, _) in enumerate(mt) if n in self._buffer_names]
        _copy([dst[i] for i in keep], [src[i] for i in keep])
        host = slot.host
        key = tuple(t.data_ptr() for t in src)
        for s in self.slots:  # plans of moved tensors hold views of the old ones: let them go
            if s.gather is not None and s.gather.key != key:
                s.gather = None
        if slot.gather is None:  # once per slot while the tensors stay where they are
            slot.gather = Gather(src, host, CHUNK // 4)
        staging = self._staging.get(dev)
        if staging is None or staging.numel() < min(CHUNK // 4, host.words):
            staging = torch.empty(min(CHUNK // 4, host.words), dtype=torch.int32, device=dev)
            staging.record_stream(side)  # freed later only once the side stream is past it
            self._staging[dev] = staging
        kept = set(keep)
        rest = [i for i in range(len(src)) if i not in kept and i not in host.flat_index]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            slot.gather.run(host, staging)
            _copy([dst[i] for i in rest], [src[i] for i in rest])
            done = torch.cuda.Event()
            done.record(side)
        self._waits.append((dev, done))
        return done

    def _before_optimizer_step(self, opt, args, kwargs) -> None:
        self._stepped = True
        for dev, ev in self._waits:
            torch.cuda.current_stream(dev).wait_event(ev)
        self._waits.clear()

    def release_through(self, seq: int, keep: "set[int] | frozenset[int]" = frozenset()) -> None:
        """Free the slots of steps begun at or before sequence number `seq`, but those of `keep`
        (a bundle still to copy from them)."""
        for s in self.slots:
            if s.step is not None and s.seq <= seq and s.seq not in keep:
                s.step, s.batch, s.rng = None, None, {}

    def find(self, step: int) -> Optional[Slot]:
        return next((s for s in self.slots if s.step == step), None)

    @property
    def nbytes(self) -> int:
        """Memory held by the ring's buffers."""
        return sum(s.nbytes for s in self.slots)

    # -- allocation (first snapshot, or when the optimizer created new state) -------------------
    def _allocate(self, slot: Slot, sig, mt, ot) -> None:
        slot.sig, slot.model, slot.optim = (), {}, {}   # drop the old buffers first
        slot.host = slot.gather = None
        like = [t for _, t in mt + ot]
        on_host = self._on_host(like, self._state_to_come())
        devs = {t.device for t in like if t.is_cuda}
        if on_host and len(devs) == 1:
            # one flat pinned buffer for the device tensors; apart: module buffers (copied on
            # the current stream) and host tensors (non-fused Adam keeps `step` on the CPU)
            apart = frozenset(i for i, (n, t) in enumerate(mt + ot)
                              if n in self._buffer_names and i < len(mt) or not t.is_cuda)
            slot.host = HostBuffers(like, apart)
            views = iter(slot.host.views)
            slot.model = {n: next(views) for n, _ in mt}
            slot.optim = {n: next(views) for n, _ in ot}
        else:
            slot.model = {n: _empty(t, on_host) for n, t in mt}
            slot.optim = {n: _empty(t, on_host) for n, t in ot}
        slot.sig = sig

    def _state_to_come(self) -> int:
        """Bytes of optimizer state not created yet: before the first optimizer step (Adam and
        the like create theirs there), two tensors per device parameter the optimizer trains
        are assumed. Otherwise the first snapshot would size the ring without them and put it
        on the device, and the next one move it to the host: a device copy of the weights held
        for nothing through the first steps (+4 % peak memory on GPT-2 small). After a step,
        the state is what exists (none for a stateless optimizer)."""
        if self.optimizer is None or self._stepped or any(self.optimizer.state.values()):
            return 0
        return 2 * sum(p.numel() * p.element_size() for p in _trained(self.optimizer)
                       if p.is_cuda)

    def _on_host(self, tensors: list[torch.Tensor], extra: int = 0) -> bool:
        if self.target is SnapshotTarget.HOST:
            return True
        if self.target is SnapshotTarget.DEVICE:
            return False
        # auto: the whole ring on the device only while it takes <= 1% of the device's memory;
        # the monitor's peak-memory budget is 2 %, and a ring holds two copies of the
        # weights and optimizer state (GPT-2 small on an H200: 3.7 GiB = 2.6 %: host)
        need = len(self.slots) * (extra + sum(t.numel() * t.element_size() for t in tensors
                                              if t.is_cuda))
        devs = {t.device for t in tensors if t.is_cuda}
        if not devs:
            return False
        total = min(torch.cuda.get_device_properties(d).total_memory for d in devs)
        return need > total / 100

    def _release_all(self) -> None:
        for s in self.slots:
            s.sig, s.model, s.optim, s.step, s.batch = (), {}, {}, None, None
            s.host = s.gather = None
        self._staging.clear()


def _empty(t: torch.Tensor, on_host: bool) -> torch.Tensor:
    if on_host and t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if not dst:
        return
    try:  # one multi-tensor launch per device group instead of one per tensor
        torch._foreach_copy_(dst, src, non_blocking=True)
    except Exception:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
