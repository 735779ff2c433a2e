"""The every-step gradient sentinel: per parameter gradient, the non-finite count, the largest
finite |x| and the sum of squares of the finite values, three float64 numbers.

`sentinel_reference` is the pure-torch twin of kernels/sentinel.py: the CPU path, the fallback
for dtypes the kernel does not read, and the kernels' test oracle. It reads every gradient of a
device in one pass of a few whole-batch ops (not a handful of ops per tensor), and never syncs.
`SentinelFrame` is what a frame carries to the detectors, in backward order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

COLS = 4                      # nonfinite, absmax, sumsq, nan
C_NONFINITE, C_ABSMAX, C_SUMSQ, C_NAN = 0, 1, 2, 3
DTYPE = torch.float64

_SEGMENTS: dict = {}          # (device, sizes) -> segment index per element, made once


def _segments(device: torch.device, sizes: tuple) -> torch.Tensor:
    key = (device, sizes)
    seg = _SEGMENTS.get(key)
    if seg is None:
        if len(_SEGMENTS) > 16:
            _SEGMENTS.clear()
        counts = torch.tensor(sizes, dtype=torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(sizes)), counts).to(device)
        _SEGMENTS[key] = seg
    return seg


def sentinel_reference(grads: list, out: torch.Tensor, slots: list) -> None:
    """out[slots[k]] += (non-finite count, -, sum of squares, NaN count) of grads[k], and
    out[slots[k], 1] = max(itself, largest finite |x|). `out` is a float64 [n, 4] tensor on the gradients'
    device (zeroed by the caller each step). No host sync."""
    grads = [g for g in grads]
    if not grads:
        return
    sizes = tuple(int(g.numel()) for g in grads)
    flat = torch.cat([g.detach().reshape(-1).to(DTYPE) for g in grads])
    seg = _segments(flat.device, sizes)
    fin = flat.isfinite()
    z = torch.where(fin, flat, 0.0)
    n = len(grads)
    part = torch.zeros(n, COLS, dtype=DTYPE, device=flat.device)
    part[:, C_NONFINITE].index_add_(0, seg, (~fin).to(DTYPE))
    part[:, C_ABSMAX].scatter_reduce_(0, seg, z.abs(), "amax")
    part[:, C_SUMSQ].index_add_(0, seg, z * z)
    part[:, C_NAN].index_add_(0, seg, flat.isnan().to(DTYPE))
    idx = torch.tensor(slots, dtype=torch.int64).to(out.device)
    cur = out.index_select(0, idx)
    merged = cur + part
    merged[:, C_ABSMAX] = torch.maximum(cur[:, C_ABSMAX], part[:, C_ABSMAX])
    out.index_copy_(0, idx, merged)


@dataclass
class SentinelFrame:
    """One step's sentinel on the host. `keys[i]` = (module, role) of a parameter gradient, in
    the order gradients became ready in backward (`ordered`; parameter order until that order
    is known); `present[i]`: the gradient existed at the step (None gradients read as 0)."""
    step: int
    keys: list
    nonfinite: np.ndarray
    absmax: np.ndarray
    sumsq: np.ndarray
    present: np.ndarray
    nan: np.ndarray
    numel: np.ndarray
    ordered: bool = True
    # ranks > 1: some rank's gradients were not finite (the flag reduced on the device)
    any_rank_bad: Optional[bool] = None
    # the guard skipped the step's optimizer update (on_nonfinite="skip")
    skipped: bool = False

    @property
    def tripped(self) -> bool:
        return bool(np.any(self.nonfinite > 0)) or bool(self.any_rank_bad)

    def first_bad(self) -> Optional[int]:
        """Index of the first gradient in backward order that holds NaN/Inf, or None."""
        bad = np.flatnonzero(self.nonfinite > 0)
        return int(bad[0]) if len(bad) else None

    @property
    def grad_norm(self) -> float:
        """L2 norm over the finite values of every gradient."""
        return math.sqrt(float(np.sum(self.sumsq)))

    @property
    def nonfinite_total(self) -> int:
        return int(np.sum(self.nonfinite))

    def index(self, module: str, role: str) -> Optional[int]:
        try:
            return self.keys.index((module, role))
        except ValueError:
            return None
