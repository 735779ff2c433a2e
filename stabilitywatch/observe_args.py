"""Checks of `Monitor.observe`'s arguments, made before anything reaches the statistics buffer:
a bad argument is the caller's error (TypeError/ValueError naming it), never a record that fails
half-way inside the monitor."""
from __future__ import annotations

import functools
import math
import numbers
import unicodedata

import torch

# a scale multiplies values before they are compared with the formats' limits in float32: out
# of float32's normal range the product loses its meaning (0, inf or subnormal noise)
SCALE_MIN = 2.0 ** -126                 # float32's smallest normal number
SCALE_MAX = float(torch.finfo(torch.float32).max)


def check_name(value, what: str, *, empty_ok: bool) -> None:
    """A role or module name: a string without whitespace or control characters."""
    if not isinstance(value, str):
        raise TypeError(f"Monitor.observe: {what} must be a str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"Monitor.observe: {what} must be a non-empty name such as 'fp8.input'")
    bad = _bad_char(value)
    if bad is not None:
        raise ValueError(f"Monitor.observe: {what} {value!r} holds {bad!r}: names are written "
                         f"without whitespace or control characters (e.g. 'fp8.amax_history')")


@functools.lru_cache(maxsize=4096)
def _bad_char(value: str):
    # cached: observe() runs per FP8 cast, with the same few names every step
    return next((c for c in value if c.isspace() or unicodedata.category(c).startswith("C")), None)


def check_scale(scale) -> None:
    """None, a finite positive real number in float32's normal range, or a one-element floating
    tensor (its value lives on the device: reading it here would wait for the GPU, so it is not
    checked)."""
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point() or scale.numel() != 1:
            raise ValueError(f"Monitor.observe: a tensor scale must be a 0-dim (one-element) "
                             f"floating tensor, got dtype {scale.dtype} and shape "
                             f"{tuple(scale.shape)}")
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"Monitor.observe: scale must be a positive number or a 0-dim floating "
                        f"tensor, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:   # an int past float's range
        value = math.inf
    if not (math.isfinite(value) and SCALE_MIN <= value <= SCALE_MAX):
        raise ValueError(f"Monitor.observe: scale must be a finite positive number within "
                         f"float32's normal range [{SCALE_MIN:.6g}, {SCALE_MAX:.6g}], "
                         f"got {scale!r}")


def check_observe(tensor, role, module, scale) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"Monitor.observe: tensor must be a torch.Tensor, "
                        f"got {type(tensor).__name__}")
    check_name(role, "role", empty_ok=False)
    check_name(module, "module", empty_ok=True)
    check_scale(scale)
