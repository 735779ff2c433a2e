"""What a scale means to the format counts, the same in the kernels, the reference and derive.

The format counts look at y = |x * s| where s is the scale read as float32 and made sane:
- its magnitude (a negative scale counts as its absolute value: the sign of x*s does not
  change whether it fits);
- NaN counts as +inf (x*NaN fits nowhere: every nonzero finite value overflows, as at +inf);
- a value below float32's smallest normal (2^-126) counts as 0 (every nonzero value
  underflows; GPUs may flush such a scale to zero, so the rule keeps GPU and CPU equal);
- a value above float32's max is +inf after the rounding.
Zeros are never counted in any format count, whatever the scale (0 * inf is NaN in IEEE
arithmetic, but a zero is representable in every format).
A scale given as a Python float is made sane on the host; a tensor-valued scale (known on the
device only) is made sane on the device, by the same rule.
"""
from __future__ import annotations

import math

import numpy as np
import torch

FLT_MIN = 2.0 ** -126          # float32's smallest normal
FLT_MAX = float(np.finfo(np.float32).max)


_SANE: dict = {}               # host scale -> its sane value: a record reads one per tensor


def effective_scale(s: float) -> float:
    """The sane float32 value of a host scale (a Python float), as a Python float."""
    got = _SANE.get(s)
    if got is None:
        got = _sane(s)
        if len(_SANE) > 1024:   # scales that change every step (delayed scaling) stay bounded
            _SANE.clear()
        _SANE[s] = got
    return got


def _sane(s: float) -> float:
    s = abs(float(s))
    if math.isnan(s):
        return math.inf
    with np.errstate(over="ignore"):
        s = float(np.float32(s))
    return 0.0 if s < FLT_MIN else s


def effective_scales(scales) -> np.ndarray:
    """effective_scale for an array of host scales (numpy, float64 result)."""
    s = np.abs(np.asarray(scales, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        s = s.astype(np.float32).astype(np.float64)
    s = np.where(np.isnan(s), math.inf, s)
    return np.where(s < FLT_MIN, 0.0, s)


def effective_scale_tensor(s: torch.Tensor) -> torch.Tensor:
    """The sane float32 value of a tensor-valued scale, a 0-dim float32 tensor on its device (no
    host sync)."""
    s = s.detach().reshape(()).to(torch.float32).abs()
    s = torch.where(s.isnan(), math.inf, s)
    return torch.where(s < FLT_MIN, 0.0, s)
