"""Low-precision number formats, described once.

Every threshold the statistics kernel, the reference and the detectors use comes from here.
Definitions, for a value x at scale s (y = x * s computed in float32):
- overflow:  x finite and |y| > fmt.max            (the cast would saturate or give Inf/NaN)
- underflow: x finite, x != 0 and |y| <= fmt.min_subnormal / 2   (round-to-nearest-even sends
             it to zero; the exact half-way value ties to the even neighbour, zero)
- subnormal: x finite and fmt.min_subnormal / 2 < |y| < fmt.subnormal_limit, where
             subnormal_limit = fmt.min_normal - fmt.min_subnormal / 2: the cast gives a nonzero
             subnormal, losing significant bits (from subnormal_limit up, round-to-nearest-even
             gives min_normal; the half-way value ties to its even mantissa)
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class Fmt(str, enum.Enum):
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class FormatSpec:
    name: Fmt
    max: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int  # explicit (stored) mantissa bits
    exponent_bits: int
    has_inf: bool
    torch_dtype: torch.dtype

    @property
    def underflow_threshold(self) -> float:
        """|y| at or below this rounds to zero."""
        return self.min_subnormal / 2

    @property
    def subnormal_limit(self) -> float:
        """|y| strictly between underflow_threshold and this casts to a nonzero subnormal."""
        return self.min_normal - self.min_subnormal / 2

    @property
    def max_log2(self) -> float:
        return math.log2(self.max)


FORMATS: dict[Fmt, FormatSpec] = {
    Fmt.E4M3: FormatSpec(Fmt.E4M3, 448.0, 2.0**-6, 2.0**-9, 3, 4, False, torch.float8_e4m3fn),
    Fmt.E5M2: FormatSpec(Fmt.E5M2, 57344.0, 2.0**-14, 2.0**-16, 2, 5, True, torch.float8_e5m2),
    Fmt.FP16: FormatSpec(Fmt.FP16, 65504.0, 2.0**-14, 2.0**-24, 10, 5, True, torch.float16),
    Fmt.BF16: FormatSpec(Fmt.BF16, float(torch.finfo(torch.bfloat16).max), 2.0**-126, 2.0**-133,
                         7, 8, True, torch.bfloat16),
    Fmt.FP32: FormatSpec(Fmt.FP32, float(torch.finfo(torch.float32).max), 2.0**-126, 2.0**-149,
                         23, 8, True, torch.float32),
}

# The formats whose overflow/underflow/subnormal counts live in every statistics row, in row order.
ROW_FORMATS: tuple[Fmt, ...] = (Fmt.E4M3, Fmt.E5M2, Fmt.FP16)


def spec(fmt: "Fmt | str") -> FormatSpec:
    """The FormatSpec for a name such as "e4m3" (ValueError on an unknown name)."""
    if isinstance(fmt, Fmt):  # str(Fmt.FP16) is "Fmt.FP16", not "fp16"
        return FORMATS[fmt]
    try:
        return FORMATS[Fmt(str(fmt).lower())]
    except ValueError:
        names = ", ".join(f.value for f in Fmt)
        raise ValueError(f"unknown number format {fmt!r}; expected one of: {names}") from None


def _scaled_abs(t: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = t.detach().float() if t.dtype != torch.float64 else t.detach()
    return x.isfinite(), (x * scale).abs()


def count_overflow(t: torch.Tensor, fmt: "Fmt | str", scale: float = 1.0) -> torch.Tensor:
    """Number of finite values with |x*scale| > fmt.max (a 0-dim int64 tensor, no host sync)."""
    f = spec(fmt)
    finite, y = _scaled_abs(t, scale)
    return (finite & (y > f.max)).sum()


def count_underflow(t: torch.Tensor, fmt: "Fmt | str", scale: float = 1.0) -> torch.Tensor:
    """Number of nonzero finite values whose |x*scale| rounds to zero in fmt."""
    f = spec(fmt)
    finite, y = _scaled_abs(t, scale)
    return (finite & (y > 0) & (y <= f.underflow_threshold)).sum()


def count_subnormal(t: torch.Tensor, fmt: "Fmt | str", scale: float = 1.0) -> torch.Tensor:
    """Number of finite values whose |x*scale| lands in fmt's subnormal range (and survives)."""
    f = spec(fmt)
    finite, y = _scaled_abs(t, scale)
    return (finite & (y > f.underflow_threshold) & (y < f.subnormal_limit)).sum()


def scale_for(amax: float, fmt: "Fmt | str", margin: int = 0) -> float:
    """Current/delayed scaling: fmt.max / amax, divided by 2**margin (1.0 for amax <= 0)."""
    f = spec(fmt)
    if not amax > 0 or not math.isfinite(amax):
        return 1.0
    return f.max / amax / (2.0**margin)
