"""Constants and small helpers shared by the tile kernel's careful pass (stats_tile.py) and its
fast pass (tile_fast.py)."""
from __future__ import annotations

import struct

import triton
import triton.language as tl

from ..formats import FORMATS, Fmt
from ..stats.layout import FMT_BASE, HIST_BINS, HIST_EMIN, Stat
from .row_ops import _decode_fp8

_INF = tl.constexpr(0x7F800000)
_MAXI = tl.constexpr(0x7FFFFFFF)
_NEGINF = tl.constexpr(-8388608)  # bits of -inf as int32


def _bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


# Row layout and format thresholds as compile-time globals, not launch arguments: every
# argument costs host time in Triton's launcher on each of the thousands of launches a step.
# Thresholds are float32 bit patterns of |y|: y > max, y > half the min subnormal, y >= the
# subnormal limit.
_E4, _E5, _F16 = FORMATS[Fmt.E4M3], FORMATS[Fmt.E5M2], FORMATS[Fmt.FP16]
TM4, TH4, TS4 = (tl.constexpr(_bits(_E4.max)), tl.constexpr(_bits(_E4.underflow_threshold)),
                 tl.constexpr(_bits(_E4.subnormal_limit) - 1))
TM5, TH5, TS5 = (tl.constexpr(_bits(_E5.max)), tl.constexpr(_bits(_E5.underflow_threshold)),
                 tl.constexpr(_bits(_E5.subnormal_limit) - 1))
TM6, TH6, TS6 = (tl.constexpr(_bits(_F16.max)), tl.constexpr(_bits(_F16.underflow_threshold)),
                 tl.constexpr(_bits(_F16.subnormal_limit) - 1))
O_E4, O_E5, O_F16 = (tl.constexpr(FMT_BASE[Fmt.E4M3]), tl.constexpr(FMT_BASE[Fmt.E5M2]),
                     tl.constexpr(FMT_BASE[Fmt.FP16]))
O_HIST = tl.constexpr(int(Stat.HIST))
HBINS = tl.constexpr(HIST_BINS)
assert HIST_EMIN == -96  # bin b of |x| is (exponent field - 31), clamped to 0..127


@triton.jit
def _tsum(v):
    return tl.sum(tl.sum(v, 2), 0)


@triton.jit
def _tmax(v):
    return tl.max(tl.max(v, 2), 0)


@triton.jit
def _tmin(v):
    return tl.min(tl.min(v, 2), 0)


@triton.jit
def _decode_tile(cur, FP8: tl.constexpr, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr):
    # a 1-D load (16-byte vectors, coalesced) seen as [U, T, V]: thread t holds [:, t, :];
    # returns the values as float32 and their bit patterns
    raw = tl.reshape(cur, [U, T, V])
    if FP8 == 1:
        x = _decode_fp8(raw.to(tl.int32), False)
        bits = x.to(tl.int32, bitcast=True)
    elif FP8 == 2:
        x = _decode_fp8(raw.to(tl.int32), True)
        bits = x.to(tl.int32, bitcast=True)
    elif FP8 == 3:  # bf16 bits (int16, sign-extended): the shift drops the extension
        bits = raw.to(tl.int32) << 16
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
    return x, bits




@triton.jit
def _add_sums(x, bits, s1, s2, s2k, kf, blo, bhi, FP8: tl.constexpr, SUM32: tl.constexpr):
    # per-thread float64 sum, sum of squares and sum of (x - kf)^2 of a tile's values (kf: the
    # program's shift, float64, or 0 where x was zeroed), and the fingerprint (sums of the low
    # and high 16 bits of each value's float32 bit pattern)
    if SUM32:  # float32 within the tile, float64 across tiles
        s1 += _tsum(x).to(tl.float64)
        s2 += _tsum(x * x).to(tl.float64)
        dk = x - kf.to(tl.float32)
        s2k += _tsum(dk * dk).to(tl.float64)
    else:
        x64 = x.to(tl.float64)
        s1 += _tsum(x64)
        s2 += _tsum(x64 * x64)
        dk = x64 - kf
        s2k += _tsum(dk * dk)
    if FP8 == 0:  # the low half is zero for bf16 and fp8 values
        blo += _tsum(bits & 0xFFFF).to(tl.int64)
    bhi += _tsum((bits >> 16) & 0xFFFF).to(tl.int64)
    return s1, s2, s2k, blo, bhi


@triton.jit
def _bit(sel, k: tl.constexpr):
    # sel (a boolean per histogram bin) as bit k of a mask
    return sel.to(tl.int32) << k


@triton.jit
def _bit_rows(mask):
    # [32, bins]: row k holds bit k of each bin's mask (0 or 1), so that a weighted sum over
    # axis 1 gives all of a program's counts in one block-wide reduction
    return (mask[None, :] >> tl.arange(0, 32)[:, None]) & 1
