"""The kernels' compile-time constants, in one place: how an input is read (Encoding), the
row's field offsets (Row, from stats/layout.py's Stat), the format thresholds, and the float32
bit patterns the compares use.

A @triton.jit function reads a module global only when it is a tl.constexpr (or a module), so
the values are tl.constexpr here: compile-time globals rather than launch arguments, since each
argument costs host time in Triton's launcher on each of the thousands of launches a step.
Launchers pass an enum member as its int (ENC=int(Encoding.BF16): Triton's `if` takes a
constexpr of type bool or int, not an int subclass); kernels compare it with the constexpr
namespaces that mirror the enums member by member (`if ENC == Enc.BF16`, `if FAST ==
Fast.LANE_HISTOGRAM`, `_put(v, idx, Row.MIN, x)`).
"""
from __future__ import annotations

import enum
import struct
import types

import torch
import triton.language as tl

from ..formats import FORMATS, Fmt
from ..stats.layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, Stat
from ..stats.scale import FLT_MIN


class Encoding(enum.IntEnum):
    """How a kernel reads its input (the constexpr ENC)."""
    FLOAT = 0   # float32 or float16, loaded and cast to float32
    E4M3 = 1    # float8_e4m3fn read as bytes and decoded with integer arithmetic
    E5M2 = 2    # float8_e5m2 read as bytes, likewise
    BF16 = 3    # bfloat16 read as int16 words: a bf16 is the top half of a float32

    @property
    def is_fp8(self) -> bool:
        return self in (Encoding.E4M3, Encoding.E5M2)


class FastPass(enum.IntEnum):
    """The tile kernel's pass over unscaled full tiles (the constexpr FAST)."""
    OFF = 0             # the careful pass only
    TL_HISTOGRAM = 1    # the fast pass, its histogram by tl.histogram (the interpreter)
    LANE_HISTOGRAM = 2  # the fast pass, its histogram in shared memory by inline PTX (GPU)


# The interpreter's own fp8 decoding is wrong, and so is its bf16 -> float32 cast of bf16
# subnormals (triton 3.9's _convert_float renormalises them): read as raw bits, both the
# interpreter and the GPU run the same exact code.
ENCODING = {torch.float32: Encoding.FLOAT, torch.float16: Encoding.FLOAT,
            torch.float8_e4m3fn: Encoding.E4M3, torch.float8_e5m2: Encoding.E5M2,
            torch.bfloat16: Encoding.BF16}
# the integer view an input is read through, where it is read as bits
BITS_VIEW = {Encoding.E4M3: torch.uint8, Encoding.E5M2: torch.uint8, Encoding.BF16: torch.int16}


def constexpr_namespace(members: type[enum.IntEnum]) -> types.ModuleType:
    """Each member of an IntEnum as a tl.constexpr attribute of the same name, in a module
    object (a global @triton.jit code may read, here and under the interpreter)."""
    ns = types.ModuleType(f"{__name__}.{members.__name__}",
                          f"{members.__name__}'s members as tl.constexpr")
    for m in members:
        setattr(ns, m.name, tl.constexpr(int(m)))
    return ns


Enc = constexpr_namespace(Encoding)
Fast = constexpr_namespace(FastPass)
Row = constexpr_namespace(Stat)
N_ROW = tl.constexpr(N_STATS)
HBINS = tl.constexpr(HIST_BINS)
HEMIN = tl.constexpr(HIST_EMIN)
assert [FMT_BASE[f] for f in (Fmt.E4M3, Fmt.E5M2, Fmt.FP16)] == [
    Stat.E4M3_OVERFLOW, Stat.E5M2_OVERFLOW, Stat.FP16_OVERFLOW]
# row bin b of |x| is its float32 exponent field - 31, clamped to 0..127
assert HIST_EMIN == -96 and HIST_BINS == 128
# The epilogues build the row's scalar fields as one 32-vector
assert int(Stat.HIST) <= 30


def float_bits(v: float) -> int:
    """The float32 bit pattern of v, as a signed int32."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


# float32 bit patterns
INF_BITS = tl.constexpr(0x7F800000)
ABS_MASK = tl.constexpr(0x7FFFFFFF)      # |x| bits; also "above every |x|" as a minimum's start
NEG_INF_BITS = tl.constexpr(-8388608)    # -inf as int32
CANONICAL_NAN = tl.constexpr(0x7FC00000)
FLT_MIN_VALUE = tl.constexpr(FLT_MIN)    # the scale rule (stats/scale.py)
# the row's unset shift (-0.0, stats/layout.py) as int64 bits, for the compare-and-swap
UNSET_SHIFT_BITS = tl.constexpr(-(2**63))

_E4, _E5, _F16 = FORMATS[Fmt.E4M3], FORMATS[Fmt.E5M2], FORMATS[Fmt.FP16]

# Format thresholds on y = |x * scale| as float values (the general kernel): overflow y > MAX,
# underflow y <= UNDERFLOW (nonzero), subnormal UNDERFLOW < y < SUBNORMAL_LIMIT
E4M3_MAX = tl.constexpr(_E4.max)
E4M3_UNDERFLOW = tl.constexpr(_E4.underflow_threshold)
E4M3_SUBNORMAL_LIMIT = tl.constexpr(_E4.subnormal_limit)
E5M2_MAX = tl.constexpr(_E5.max)
E5M2_UNDERFLOW = tl.constexpr(_E5.underflow_threshold)
E5M2_SUBNORMAL_LIMIT = tl.constexpr(_E5.subnormal_limit)
FP16_MAX = tl.constexpr(_F16.max)
FP16_UNDERFLOW = tl.constexpr(_F16.underflow_threshold)
FP16_SUBNORMAL_LIMIT = tl.constexpr(_F16.subnormal_limit)

# The same thresholds as float32 bit patterns of |y| (the tile kernels), each for a count of
# u > BITS, u = |y|'s bits (their integer order is the order of |y|): *_MAX_BITS counts
# overflow, *_UNDERFLOW_BITS the values that do not underflow, *_NORMAL_BITS (the subnormal
# limit's bits - 1) the values at or above the subnormal limit.
E4M3_MAX_BITS = tl.constexpr(float_bits(_E4.max))
E4M3_UNDERFLOW_BITS = tl.constexpr(float_bits(_E4.underflow_threshold))
E4M3_NORMAL_BITS = tl.constexpr(float_bits(_E4.subnormal_limit) - 1)
E5M2_MAX_BITS = tl.constexpr(float_bits(_E5.max))
E5M2_UNDERFLOW_BITS = tl.constexpr(float_bits(_E5.underflow_threshold))
E5M2_NORMAL_BITS = tl.constexpr(float_bits(_E5.subnormal_limit) - 1)
FP16_MAX_BITS = tl.constexpr(float_bits(_F16.max))
FP16_UNDERFLOW_BITS = tl.constexpr(float_bits(_F16.underflow_threshold))
FP16_NORMAL_BITS = tl.constexpr(float_bits(_F16.subnormal_limit) - 1)

# Timing-only part switches of the passes (kernels/_timing.py): a pass computes the parts
# whose bits are set; the row is right only with ALL_PARTS, which production launches pass.
PART_COUNTS = tl.constexpr(1)  # the format / threshold counts (fp8 byte pass: the scalars)
PART_HIST = tl.constexpr(2)    # the exponent histogram
ALL_PARTS = tl.constexpr(3)

