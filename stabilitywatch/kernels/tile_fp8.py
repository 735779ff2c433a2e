"""The tile kernel's pass for fp8 tensors: count each of the 256 byte values, then derive every
statistic from the 256 counts.

An fp8 tensor holds at most 256 distinct values, so its row is a function of how often each
value occurs: the extrema are the extreme values present, the sums are sum(count * value) (each
term exact in float64), the format counts at any scale add the counts of the values whose
|value * scale| passes the threshold, the exponent histogram adds counts by exponent, and the
fingerprint adds count * the value's float32 bit halves. Per element that leaves one shared-memory
increment (ptx._lane_hist_count_byte), where decoding and reducing each element took ~50
instructions. NaN, Inf and scales need no separate path: they are values like the others.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from ..formats import FORMATS, Fmt
from .constants import (ABS_MASK, ALL_PARTS, CANONICAL_NAN, E4M3_MAX_BITS, E4M3_NORMAL_BITS,
                        E4M3_UNDERFLOW_BITS, E5M2_MAX_BITS, E5M2_NORMAL_BITS,
                        E5M2_UNDERFLOW_BITS, FP16_MAX_BITS, FP16_NORMAL_BITS,
                        FP16_UNDERFLOW_BITS, HBINS, INF_BITS, NEG_INF_BITS, PART_COUNTS, PART_HIST,
                        Enc, Row)
from .ptx import _l2_prefetch, _lane_hist_count_byte, _lane_hist_init, _lane_hist_read
from .row_ops import _decode_fp8, _put
from .tile_ops import _bit, _bit_rows


def _row_bins(fmt: Fmt) -> tuple[int, int]:
    # the lowest and highest row bin (exponent field - 31) of a format's nonzero finite values
    f = FORMATS[fmt]
    lo, hi = (math.frexp(v)[1] - 1 + 127 - 31 for v in (f.min_subnormal, f.max))
    return lo, hi


_LOS, _HIS = zip(*(_row_bins(f) for f in (Fmt.E4M3, Fmt.E5M2)))
K_LO, KN = tl.constexpr(min(_LOS)), tl.constexpr(32)
assert max(_HIS) < K_LO.value + KN.value and 0 <= K_LO.value  # (80, 111) on this layout


@triton.jit
def _count(h, sel):
    return tl.sum(tl.where(sel, h, 0).to(tl.int64), 0)


@triton.jit
def _fold(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9):
    return (tl.minimum(a0, b0), tl.maximum(a1, b1), tl.maximum(a2, b2), tl.minimum(a3, b3),
            a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9)


@triton.jit
def _row_hist(h, ENC: tl.constexpr, PARTS: tl.constexpr):
    # The row's histogram from the 256 byte counts, summed here: one atomic per bin and program.
    # (Each byte's count as its own atomic put ~16 same-address float64 atomics per bin and
    # program on the row, which serialize across programs: ~50 us per launch on the H200, most
    # of a mid-size tensor's time.) Byte j and byte j + 128 hold the same |value|; its row bin
    # is its exponent field - 31 (nonzero finite values only), within the KN bins from K_LO for
    # both formats. Without PART_HIST (timing only): none.
    bins = tl.arange(0, HBINS)
    if (PART_HIST & PARTS) == 0:
        return tl.zeros([HBINS], dtype=tl.int32)
    hm = tl.sum(tl.reshape(h, [2, 128]), 0)
    xm = _decode_fp8(tl.arange(0, 128), ENC == Enc.E5M2)
    um = xm.to(tl.int32, bitcast=True) & ABS_MASK
    km = tl.where((um < INF_BITS) & (um != 0), (um >> 23) - 31 - K_LO, -1)
    w = tl.arange(0, KN)
    hw = tl.sum(tl.where(w[:, None] == km[None, :], hm[None, :], 0), 1)
    inside = (bins >= K_LO) & (bins < K_LO + KN)
    return tl.where(inside, tl.gather(hw, tl.where(inside, bins - K_LO, 0), 0), 0)


@triton.jit
def _count_bytes(cur, h, table, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                 LANE: tl.constexpr):
    if LANE:
        _lane_hist_count_byte(tl.reshape(cur, [U, T, V]).to(tl.int32), table)
    else:
        h += tl.histogram(cur.to(tl.int32), 256)
    return h


@triton.jit
def _fp8_tiles(x_ptr, scale, n_full, pid, nprog, lanes, krow, ENC: tl.constexpr,
               U: tl.constexpr, T: tl.constexpr, V: tl.constexpr, LANE: tl.constexpr,
               PREF: tl.constexpr, PARTS: tl.constexpr = ALL_PARTS):
    # Returns the row's scalar fields as a 32-vector and the row's histogram (HBINS counts).
    # LANE: the shared-memory lane histogram (GPU) instead of tl.histogram. PREF (GPU): L2
    # prefetch, tiles ahead. krow: the row's shift (the shifted sums are taken at it directly,
    # from the byte values). PARTS (timing only, kernels/_timing.py; the row is wrong without
    # ALL_PARTS): PART_COUNTS the scalar fields, PART_HIST the histogram.
    TILE: tl.constexpr = U * T * V
    b = tl.arange(0, 256)
    h = tl.zeros([256], dtype=tl.int32)
    if LANE:
        table = _lane_hist_init(pid * 0)
        tl.debug_barrier()
    else:
        table = pid * 0
    step = nprog * TILE
    last = n_full - TILE
    nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(pid * TILE, last), TILE) + lanes)
    for start in range(pid * TILE, n_full, step):
        cur = nxt
        nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(start + step, last), TILE) + lanes)
        if PREF:
            _l2_prefetch(x_ptr + tl.minimum(start + PREF * step, last), TILE)
        h = _count_bytes(cur, h, table, U, T, V, LANE)
    if LANE:
        tl.debug_barrier()
        h = _lane_hist_read(b)
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    if (PART_COUNTS & PARTS) == 0:
        v = _put(v, idx, Row.NAN, _count(h, b == 1))  # keeps the loop's counts alive
        return v, _row_hist(h, ENC, PARTS)
    x = _decode_fp8(b, ENC == Enc.E5M2)  # the value of each byte
    bits = x.to(tl.int32, bitcast=True)
    u = bits & ABS_MASK
    fin = u < INF_BITS
    nz = fin & (u != 0)
    present = h > 0
    hf = h.to(tl.float64)
    x64 = tl.where(fin, x, 0.0).to(tl.float64)
    dk = tl.where(fin, x.to(tl.float64) - krow, 0.0)
    fbits = tl.where(u > INF_BITS, CANONICAL_NAN, bits)  # canonical NaN, as in the reference
    h64 = h.to(tl.int64)
    # one block-wide reduction for the extrema, sums and fingerprint, one for every count (each
    # is a barrier and a shared-memory round trip, in a chain the program ends on)
    mn, mx, amx, amn, s1, s2, blo, bhi, sk1, sk2 = tl.reduce(
        (tl.where(present & fin, x, float("inf")), tl.where(present & fin, x, float("-inf")),
         tl.where(present & fin, tl.abs(x), float("-inf")),
         tl.where(present & nz, tl.abs(x), float("inf")), hf * x64, hf * x64 * x64,
         h64 * (fbits & 0xFFFF), h64 * ((fbits >> 16) & 0xFFFF), hf * dk, hf * dk * dk), 0,
        _fold)
    # y = |x * scale| in float32, as the reference computes it; zeros stay out of the format
    # counts (0 * inf is NaN, whose bits pass every threshold)
    yu = tl.abs(x * scale).to(tl.int32, bitcast=True) & ABS_MASK
    # bit k of sel: the byte value counts in the row's field k
    sel = (_bit(u > INF_BITS, Row.NAN) | _bit(bits == INF_BITS, Row.POSINF)
           | _bit(bits == NEG_INF_BITS, Row.NEGINF) | _bit(fin & (u == 0), Row.ZEROS)
           | _bit(nz & (yu > E4M3_MAX_BITS), Row.E4M3_OVERFLOW)
           | _bit(nz & (yu <= E4M3_UNDERFLOW_BITS), Row.E4M3_UNDERFLOW)
           | _bit(nz & (yu > E4M3_UNDERFLOW_BITS) & (yu <= E4M3_NORMAL_BITS), Row.E4M3_SUBNORMAL)
           | _bit(nz & (yu > E5M2_MAX_BITS), Row.E5M2_OVERFLOW)
           | _bit(nz & (yu <= E5M2_UNDERFLOW_BITS), Row.E5M2_UNDERFLOW)
           | _bit(nz & (yu > E5M2_UNDERFLOW_BITS) & (yu <= E5M2_NORMAL_BITS), Row.E5M2_SUBNORMAL)
           | _bit(nz & (yu > FP16_MAX_BITS), Row.FP16_OVERFLOW)
           | _bit(nz & (yu <= FP16_UNDERFLOW_BITS), Row.FP16_UNDERFLOW)
           | _bit(nz & (yu > FP16_UNDERFLOW_BITS) & (yu <= FP16_NORMAL_BITS), Row.FP16_SUBNORMAL))
    cnt = tl.sum(_bit_rows(sel) * h[None, :], 1)  # int32: a program reads < 2^31
    counted = (((idx >= Row.NAN) & (idx <= Row.ZEROS))
               | ((idx >= Row.E4M3_OVERFLOW) & (idx < Row.FP16_SUBNORMAL + 1)))
    v = tl.where(counted, cnt.to(tl.float64), 0.0)
    v = _put(v, idx, Row.NUMEL, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, Row.MIN, mn)
    v = _put(v, idx, Row.MAX, mx)
    v = _put(v, idx, Row.ABSMAX, amx)
    v = _put(v, idx, Row.ABSMIN_NZ, amn)
    v = _put(v, idx, Row.SUM, s1)
    v = _put(v, idx, Row.SUMSQ, s2)
    v = _put(v, idx, Row.BITS_LO, blo)
    v = _put(v, idx, Row.BITS_HI, bhi)
    v = _put(v, idx, Row.SHIFT_SUM, sk1)
    v = _put(v, idx, Row.SHIFT_SUMSQ, sk2)
    return v, _row_hist(h, ENC, PARTS)  # last: fewer registers live (80 against 95)
