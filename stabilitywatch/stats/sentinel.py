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
# the step's cross-rank flags (guard.CrossRankFlag) hold ranks as RANK_BIG - rank (the MAX of
# which is the lowest): exact in float32 up to this many ranks
RANK_BIG = float(1 << 24)
C_NONFINITE, C_ABSMAX, C_SUMSQ, C_NAN = 0, 1, 2, 3
DTYPE = torch.float64

_INDEX: dict = {}             # (device, slots) -> the slots as an index tensor, made once


def _index(device: torch.device, slots: tuple) -> torch.Tensor:
    idx = _INDEX.get((device, slots))
    if idx is None:
        if len(_INDEX) > 16:
            _INDEX.clear()
        idx = _INDEX[(device, slots)] = torch.tensor(slots, dtype=torch.int64).to(device)
    return idx


def sentinel_reference(grads: list, out: torch.Tensor, slots: list) -> None:
    """out[slots[k]] += (non-finite count, -, sum of squares, NaN count) of grads[k], and
    out[slots[k], 1] = max(itself, largest finite |x|). `out` is a float64 [n, 4] tensor on the
    gradients' device (zeroed by the caller each step). No host sync.

    The gradients are read as one flat tensor (one copy): the element-wise work is a handful of
    whole-batch ops, and the per-gradient reductions are foreach ops over views of it (a loop of
    ops per gradient costs ~10 host us each; a scatter by segment index is slower still)."""
    keep = [(g, s) for g, s in zip(grads, slots) if g.numel()]
    if not keep:
        return
    sizes = [int(g.numel()) for g, _ in keep]
    work = torch.float64 if any(g.dtype == torch.float64 for g, _ in keep) else torch.float32
    flat = torch.cat([g.detach().reshape(-1).to(work) for g, _ in keep])
    a = flat.abs()
    fin = a < float("inf")               # False for NaN and +-Inf
    af = torch.where(fin, a, 0.0)
    bad = torch.where(fin, 0.0, 1.0).to(work)
    nan = flat.isnan().to(work)
    f64 = torch.float64
    absmax = torch._foreach_max(af.split(sizes))
    norm = torch._foreach_norm(af.split(sizes), 2, dtype=f64)
    n_bad = torch._foreach_norm(bad.split(sizes), 1, dtype=f64)
    n_nan = torch._foreach_norm(nan.split(sizes), 1, dtype=f64)
    part = torch.stack([torch.stack(n_bad), torch.stack(absmax).to(f64),
                        torch.stack(norm).square(), torch.stack(n_nan)], 1)
    idx = _index(out.device, tuple(s for _, s in keep))
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
    bad_rank: Optional[int] = None     # then: the highest rank whose gradients were not finite
    bad_rank_lo: Optional[int] = None  # and the lowest
    # [len(keys), 2]: per gradient the lowest and highest rank whose gradient held NaN/Inf (-1:
    # none), from the same every-step reduction, when the ranks watch the same gradients
    row_ranks: Optional[np.ndarray] = None
    # the guard skipped the step's optimizer update (guard.on_nonfinite="skip")
    skipped: bool = False

    @property
    def tripped(self) -> bool:
        return bool(np.any(self.nonfinite > 0)) or bool(self.any_rank_bad)

    def first_bad(self) -> Optional[int]:
        """Index of the first gradient in backward order that holds NaN/Inf, or None."""
        # np.flatnonzero of a 1-D array
        bad = (np.asarray(self.nonfinite) > 0).nonzero()[0]   # sync-ok: numpy
        return int(bad[0]) if len(bad) else None

    @property
    def grad_norm(self) -> float:
        """L2 norm over the finite values of every gradient."""
        return math.sqrt(float(np.add.reduce(self.sumsq)))   # np.sum, without its wrapper

    @property
    def nonfinite_total(self) -> int:
        return int(np.add.reduce(self.nonfinite))

    def index(self, module: str, role: str) -> Optional[int]:
        try:
            return self.keys.index((module, role))
        except ValueError:
            return None
