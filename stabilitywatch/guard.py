"""The guard (opt-in, `Config(guard={"on_nonfinite": "skip"})`): a step whose gradients are not
finite is skipped, and the cross-rank flag that decides it.

The decision comes from the sentinel (stats/sentinel_store.py), on the device: `flag` is a
float32 0-dim tensor, 1.0 when a watched gradient holds NaN/Inf. Under torch.distributed it is
reduced across ranks first (all_reduce MAX, async: on NCCL the wait is a stream wait, not a
host wait), so every rank skips the same step; the same reduced flag drives escalation there.

- Fused optimizers (torch.optim Adam, AdamW, SGD, Adagrad with fused=True: those that set
  `_step_supports_amp_scaling`) read `optimizer.found_inf` in step(), as they do for GradScaler:
  a set flag makes the fused kernel leave parameters and state untouched and the `step` count
  is taken back. No host sync. A GradScaler's own found_inf is combined (max) with ours and put
  back after the step.
- Any other optimizer: the flag is read on the host (one sync per step, only there) and, when
  set, every parameter's gradient is set to None before step() runs: torch optimizers skip
  parameters without a gradient, so nothing moves (the loop's zero_grad() after it is a no-op).

The latch (`hold=True`, on while captures are on): frames are read on the host a step late, so
a capture of a skipped step N finds the weights moved by step N+1 unless those steps are skipped
too. A set flag latches (on the device, no sync: the step number of the first skipped step) and
every later step is skipped until the host has read step N's frame, copied the state it needs,
and called `release(N)`; the latch lets go by itself after HOLD_LIMIT steps, so a frame never
read cannot stop training.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch

from .stats.sentinel import RANK_BIG

log = logging.getLogger("stabilitywatch")

_NO_PREV = object()
HOLD_LIMIT = 8   # steps the latch skips at most when the host never releases it


def inner_optimizer(opt):
    """The torch.optim optimizer whose step() runs (through wrappers such as Accelerate's)."""
    seen = 0
    while not hasattr(opt, "_step_supports_amp_scaling") and seen < 4:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        opt, seen = inner, seen + 1
    return opt


def is_fused(opt) -> bool:
    opt = inner_optimizer(opt)
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in opt.param_groups)


class CrossRankFlag:
    """One all_reduce(MAX) per step over the default process group (the job's own: the flags
    live on the gradients' device), started async; its wait orders the consumers after it on
    the device (NCCL: a stream wait). It carries the step's flag and the sentinel's per-rank
    badness: per watched gradient, the lowest and highest rank whose gradient held NaN/Inf
    (2 + 2 x gradients float32 values, whatever the world size)."""

    def __init__(self, keys=()):
        import torch.distributed as dist
        self.dist = dist
        self.backend = dist.get_backend()
        self.rank = dist.get_rank()
        self.rows = len(keys) if keys and self._same_everywhere(list(keys)) else 0

    def _device(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend == "nccl" and not t.is_cuda:
            return t.to(torch.device("cuda", torch.cuda.current_device()))
        if self.backend == "gloo" and t.is_cuda:
            return t.cpu()   # sync-ok: gloo runs on the host; CUDA jobs use NCCL
        return t

    def _same_everywhere(self, keys: list) -> bool:
        """At watch(), once (a host wait, off the steps): do all ranks watch the same gradients
        in the same order? Per-gradient flags need it; without it the flag goes alone."""
        d = float(int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:6], "big"))
        t = self._device(torch.tensor([len(keys), -len(keys), d, -d], dtype=torch.float64))
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        v = t.cpu().tolist()   # sync-ok: once, at watch()
        return v[0] == -v[1] and v[2] == -v[3]

    def reduce(self, flag: torch.Tensor, bad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 [2 + 2 x rows], the MAX over ranks of: flag x (rank + 1) (0 when every
        rank's gradients were finite, else 1 + the highest rank whose were not); flag x
        (RANK_BIG - rank) (RANK_BIG - the lowest); then per gradient (`bad`: this rank's
        non-finite counts, in the sentinel's row order) the same two for its gradient."""
        r = self.rank
        f = flag.detach().reshape(1).to(torch.float32)
        parts = [f * (r + 1), f * (RANK_BIG - r)]
        if self.rows:
            b = torch.zeros(self.rows, dtype=torch.float32, device=f.device) if bad is None \
                else (bad.detach().reshape(-1)[:self.rows] > 0).to(device=f.device,
                                                                  dtype=torch.float32)
            parts += [b * (r + 1), b * (RANK_BIG - r)]
        out = self._device(torch.cat(parts))
        work = self.dist.all_reduce(out, op=self.dist.ReduceOp.MAX, async_op=True)
        work.wait()
        return out


class Guard:
    def __init__(self, optimizer, hold: bool = False):
        self.opt = inner_optimizer(optimizer)
        self.fused = is_fused(self.opt)
        self.hold = hold
        self._prev = _NO_PREV
        self._device: Optional[torch.device] = None
        self.skipped_host: list[int] = []   # steps the host-side fallback skipped
        # first skipped step + 1 while latched, else 0: a device tensor (fused) or an int (host)
        self._latch: "torch.Tensor | int" = 0

    def before_step(self, flag: torch.Tensor, step: Optional[int]) -> None:
        """Called in the optimizer's pre-step hook with this step's (reduced) flag."""
        if self.fused:
            if self._device is None:   # the fused kernels read found_inf on the params' device
                devs = {p.device for g in self.opt.param_groups for p in g["params"]}
                self._device = next(iter(devs)) if len(devs) == 1 else flag.device
            f = flag.detach().to(device=self._device, dtype=torch.float32).reshape(())
            if self.hold and step is not None:
                f = self._latched(f, step)
            prev = getattr(self.opt, "found_inf", None)
            self._prev = prev
            if prev is not None:   # a GradScaler's: both must be clean for the step to run
                f = torch.maximum(prev.to(f).reshape(()), f).reshape(prev.shape)
            self.opt.found_inf = f
            return
        bad = float(flag) > 0   # sync-ok: the documented fallback for non-fused optimizers
        if self.hold and step is not None:
            held = self._latch and step + 1 - self._latch < HOLD_LIMIT
            self._latch = self._latch if held else (step + 1 if bad else 0)
            bad = bad or bool(held)
        if bad:
            for g in self.opt.param_groups:
                for p in g["params"]:
                    p.grad = None
            if step is not None:
                self.skipped_host.append(step)

    def _latched(self, f: torch.Tensor, step: int) -> torch.Tensor:
        """This step's skip flag with the latch applied, and the latch updated (device ops)."""
        if not isinstance(self._latch, torch.Tensor):
            self._latch = torch.zeros((), dtype=torch.int64, device=self._device)
        latch = self._latch
        held = (latch > 0) & (step + 1 - latch < HOLD_LIMIT)
        new = torch.where(held, latch, torch.where(f > 0, step + 1, 0))
        latch.copy_(new)
        return torch.maximum(f, held.to(f.dtype))

    def release(self, through: int) -> None:
        """The host has read the frames through step `through` (and copied what it needs): a
        latch set at or before it lets go. A latch set later holds."""
        if isinstance(self._latch, torch.Tensor):
            self._latch.masked_fill_(self._latch <= through + 1, 0)   # on the device, no sync
        elif self._latch and self._latch <= through + 1:
            self._latch = 0

    def after_step(self) -> None:
        """The optimizer's post-step hook: the attribute as it was (GradScaler deletes its own)."""
        if self._prev is _NO_PREV:
            return
        prev, self._prev = self._prev, _NO_PREV
        if prev is None:
            if hasattr(self.opt, "found_inf"):
                del self.opt.found_inf
        else:
            self.opt.found_inf = prev
