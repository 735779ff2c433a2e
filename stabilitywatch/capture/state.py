"""What the default capture policy keeps, and the one copy of the state it makes.

Every step (cheap, no tensor copy): a reference to the batch, the RNG states (Python, NumPy,
torch CPU and CUDA: ~10 KB) and the optimizer's hyper-parameters, kept in a short ring until the
step's frame has been read. The weights and optimizer state are copied only for a bundle, once,
at a step boundary on the training thread: the current state, which is the flagged step's
start-of-step state when the guard skipped that step and still holds it (guard.py), or the
start-of-step snapshot of the "sampled"/"every" policies.

The copy goes to host memory when it fits the budget: at most HOST_FRACTION of the machine's
physical memory and what capture_max_bytes leaves. Otherwise the bundle is written without it
and its manifest says so (`lacks`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from .rng import RngStates
from .snapshot import _model_tensors, _optim_tensors, _plain

HOST_FRACTION = 0.25   # of physical host memory, at most, for the one copy of a bundle's state
RING = 16              # steps whose batch and RNG states are held while their frame is unread


@dataclass
class StepRecord:
    """One step begun: what a bundle of it needs besides the weights."""
    step: int
    seq: int
    batch: Any                       # by reference: the loop must not modify it in place
    rng: dict
    hyper: Optional[list] = None     # per param group: its hyper-parameters at the step start


class StepRing:
    def __init__(self, optimizer: Optional[torch.optim.Optimizer], size: int = RING):
        self.optimizer, self.size = optimizer, size
        self.records: list[StepRecord] = []
        self.rng = RngStates()

    def add(self, step: int, seq: int, batch: Any) -> None:
        """At the step start (hot path: host work only, no tensor copy, no sync)."""
        hyper = None
        if self.optimizer is not None:   # an LR schedule changes these between steps
            # values kept as they are (made JSON-able when a bundle is written, with_hyper),
            # but what can change in place: a tensor (lr on the device), a list
            hyper = [{k: _plain(v) if isinstance(v, (torch.Tensor, list)) else v
                      for k, v in g.items() if k != "params"}
                     for g in self.optimizer.param_groups]
        self.records = self.records[-(self.size - 1):] + [
            StepRecord(step, seq, batch, self.rng.read(), hyper)]

    def find(self, step: int) -> Optional[StepRecord]:
        return next((r for r in reversed(self.records) if r.step == step), None)

    def release_through(self, seq: int) -> None:
        self.records = [r for r in self.records if r.seq > seq]

    def clear(self) -> None:
        self.records = []


@dataclass
class StateCopy:
    """Host copies of the weights and optimizer state, valid as the start-of-step state of the
    steps first..last (the guard skipped all of them)."""
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    meta: Optional[dict]
    first: int
    last: int
    nbytes: int = field(default=0)


def state_nbytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 names: dict[int, str]) -> int:
    """Bytes of the weights, buffers and per-element optimizer state (metadata only)."""
    mt = _model_tensors(model)
    ot, _ = _optim_tensors(optimizer, names)
    return sum(t.numel() * t.element_size() for _, t in mt + ot)


def copy_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
               names: dict[int, str], first: int, last: int) -> StateCopy:
    """Copy the current state to host memory. Training thread, at a step boundary: the copies
    are queued on the current stream, ahead of the next optimizer step; to the host they wait
    for the device (once per bundle, off the hot path)."""
    mt = _model_tensors(model)
    ot, meta = _optim_tensors(optimizer, names)
    events = {}
    with torch.no_grad():
        m = {n: to_host(t, events) for n, t in mt}
        o = {n: to_host(t, events) for n, t in ot}
    for ev in events.values():   # sync-ok: once per bundle, at a step boundary
        ev.synchronize()
    nbytes = sum(t.numel() * t.element_size() for d in (m, o) for t in d.values())
    return StateCopy(m, o, meta, first, last, nbytes)


def to_host(t: torch.Tensor, events: dict) -> torch.Tensor:
    """A host copy: from the device into pinned memory on the current stream, waited for once
    per device with an event (no stream-wide synchronize)."""
    t = t.detach()
    if not t.is_cuda:
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    events[t.device] = ev   # the last one recorded on each device covers the earlier copies
    return out


def with_hyper(meta: Optional[dict], hyper: Optional[list]) -> Optional[dict]:
    """Optimizer metadata with the param groups' hyper-parameters of the step's start."""
    if meta is None or hyper is None or len(hyper) != len(meta.get("param_groups", ())):
        return meta
    groups = [{**{k: _plain(v) for k, v in h.items()}, "params": g["params"]}
              for g, h in zip(meta["param_groups"], hyper)]
    return {**meta, "param_groups": groups}


def host_budget() -> Optional[int]:
    """HOST_FRACTION of physical memory in bytes; None where the system does not say."""
    try:
        return int(HOST_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None
