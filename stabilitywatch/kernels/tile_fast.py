"""The tile kernel's fast pass: no per-tile block-wide reductions and no branches, for the usual
case of finite values and scale 1.

Per element it keeps running extrema, float64 sums, the fingerprint and one count in a 256-bin
histogram of the float32 exponent field of |x| (zeros in bin 0, Inf/NaN in bin 255), whose bins
also count, in their high half, the values at or above their field's threshold
(THRESHOLDS below).
Everything else comes from that histogram once, at the end: zeros, the nonzero count, the seven
threshold counts (E4M3 max, three underflow thresholds, three subnormal limits; hence underflow =
nonzero - #(u > threshold)), the E5M2 and fp16 overflow counts, and the row's 128 bins (seven
compares per element instead: docs/kernels.md, "What loses, and why").

Those derivations are exact only when the program's data has none of:
- Inf or NaN (bin 255),
- a float32 subnormal (it would sit in bin 0 with the zeros),
- a value in [2^15, 2^16), the bin that holds the E5M2 and fp16 maxima,
- a value of 2^60 or more (its square could overflow float32 before the float64 sum).
A program that meets one of these (one flag, decided once at the end) runs the careful pass
(stats_tile._careful_tiles) over its tiles instead: rare data pays a second read, the rest
pays nothing for it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import (ABS_MASK, ALL_PARTS, E4M3_MAX_BITS, E4M3_NORMAL_BITS,
                        E4M3_UNDERFLOW_BITS, E5M2_MAX_BITS, E5M2_NORMAL_BITS,
                        E5M2_UNDERFLOW_BITS, FP16_MAX_BITS, FP16_NORMAL_BITS,
                        FP16_UNDERFLOW_BITS, HBINS, PART_COUNTS, PART_HIST, Enc, Row)
from .ptx import (THR_ROWS, TOP_ROW, _THR_SLOT_HI, _THR_SLOT_LO, _bf16x2_max, _bf16x2_min,
                  _halves_sum, _l2_prefetch, _lane_col, _lane_hist_add_at, _lane_hist_count,
                  _lane_hist_init_thr_ptx, _lane_hist_init_with, _lane_hist_read2,
                  _lane_thr_slot, _s16x2_min, _thr_value)
from .row_ops import _at_row_shift, _put
from .tile_ops import _add_sums, _bit, _bit_rows, _decode_tile, _tmax, _tmin, _tsum


def _field(bits) -> int:
    return int(bits) >> 23


assert _field(E5M2_MAX_BITS) == _field(FP16_MAX_BITS) == 142 and _field(E4M3_MAX_BITS) < 142
FLD_MAXES = tl.constexpr(142)  # [2^15, 2^16): holds the E5M2 and fp16 maxima
FLD_BIG = tl.constexpr(127 + 60)  # |x| >= 2^60
# the 32-vector slot (past the row's scalar fields) where _hist_counts puts the count of values
# the fast pass cannot count exactly
NOT_EXACT = tl.constexpr(30)
assert (Row.E4M3_OVERFLOW + 3 == Row.E5M2_OVERFLOW and Row.E5M2_OVERFLOW + 3 == Row.FP16_OVERFLOW
        and Row.HIST <= NOT_EXACT)


# Six of the seven threshold counts sit in six different exponent fields: count(|x| > K) =
# (values in fields above K's) + (values in K's field at or above K + 1). The histogram's bin of
# field f counts, in its high 16 bits, the values at or above the threshold THRESHOLDS[f] of
# that field (one table lookup and one compare per element, whatever the number of
# thresholds). The seventh, fp16's subnormal limit, shares field 112 with E5M2's: bf16 and fp8
# values (at most 7 mantissa bits) never lie between it and 2^-14, so it is (values in fields
# >= 113); float32 and fp16 inputs compare each element with it.
_COUNTED = (FP16_UNDERFLOW_BITS, E5M2_UNDERFLOW_BITS, E5M2_NORMAL_BITS, E4M3_UNDERFLOW_BITS,
            E4M3_NORMAL_BITS, E4M3_MAX_BITS)
THRESHOLDS = {_field(t): int(t) + 1 for t in _COUNTED}
assert len(THRESHOLDS) == 6 and _field(FP16_NORMAL_BITS) == _field(E5M2_NORMAL_BITS) == 112
assert (int(FP16_NORMAL_BITS) + 1) & 0x7FFFFF > 0x7F0000  # above every 7-bit mantissa, field 112
# each threshold's exponent field (FLD_*) and its table word there (THR_*: the bits it counts
# from)
(FLD_FP16_UNDER, FLD_E5M2_UNDER, FLD_E5M2_NORMAL, FLD_E4M3_UNDER, FLD_E4M3_NORMAL,
 FLD_E4M3_MAX) = (tl.constexpr(_field(t)) for t in _COUNTED)
(THR_FP16_UNDER, THR_E5M2_UNDER, THR_E5M2_NORMAL, THR_E4M3_UNDER, THR_E4M3_NORMAL,
 THR_E4M3_MAX) = (tl.constexpr(THRESHOLDS[_field(t)]) for t in _COUNTED)
_INIT_THR = tl.constexpr(_lane_hist_init_thr_ptx(THRESHOLDS))


@triton.jit
def _thr_key(u, N: tl.constexpr):
    # the interpreter's twin of the lane count: field + 256 when u >= the field's threshold
    fld = u >> 23
    t = tl.where(fld == FLD_FP16_UNDER, THR_FP16_UNDER,
                 tl.where(fld == FLD_E5M2_UNDER, THR_E5M2_UNDER,
                          tl.where(fld == FLD_E5M2_NORMAL, THR_E5M2_NORMAL,
                                   tl.where(fld == FLD_E4M3_UNDER, THR_E4M3_UNDER,
                                            tl.where(fld == FLD_E4M3_NORMAL, THR_E4M3_NORMAL,
                                                     tl.where(fld == FLD_E4M3_MAX, THR_E4M3_MAX,
                                                              ABS_MASK))))))
    above = (u >= t) & (t != ABS_MASK)
    return tl.reshape(fld + tl.where(above, 256, 0), [N])


@triton.jit
def _top_rows(h, ab, f):
    # The lane histogram's rows TOP_ROW.. hold the threshold table (ptx.THR_ROWS): their fields'
    # counts become 1 where a count changed a row's total from its initial words (a value the
    # fast pass does not keep), else 0; no row of theirs has a threshold count
    init = (tl.where(f == FLD_FP16_UNDER + THR_ROWS, THR_FP16_UNDER, 0)
            + tl.where(f == FLD_E5M2_UNDER + THR_ROWS, THR_E5M2_UNDER, 0)
            + tl.where(f == FLD_E5M2_NORMAL + THR_ROWS, THR_E5M2_NORMAL, 0)
            + tl.where(f == FLD_E4M3_UNDER + THR_ROWS, THR_E4M3_UNDER, 0)
            + tl.where(f == FLD_E4M3_NORMAL + THR_ROWS, THR_E4M3_NORMAL, 0)
            + tl.where(f == FLD_E4M3_MAX + THR_ROWS, THR_E4M3_MAX, 0))
    moved = ab.to(tl.int64) * 65536 + h.to(tl.int64) - 32 * init.to(tl.int64)
    top = f >= TOP_ROW
    return tl.where(top, (moved != 0).to(tl.int32), h), tl.where(top, 0, ab)


@triton.jit
def _fold(a0, a1, a2, a3, a4, a5, a6, a7, a8, b0, b1, b2, b3, b4, b5, b6, b7, b8):
    return (tl.minimum(a0, b0), tl.maximum(a1, b1), tl.minimum(a2, b2), a3 + b3, a4 + b4,
            a5 + b5, a6 + b6, a7 + b7, a8 + b8)


@triton.jit
def _span(f, lo, hi, k: tl.constexpr):
    # bit k set for the fields lo <= f < hi
    return _bit((f >= lo) & (f < hi), k)


@triton.jit
def _hist_counts(h, ab, f, ENC: tl.constexpr):
    # The row's counts (at their Row offsets in a 32-vector; NOT_EXACT at its own slot) as sums
    # of h and ab over field ranges, all in one reduction: bit k of pos/neg (apos/aneg) says that
    # h[f] (ab[f]) adds to / takes from count k. What each count is: the module's docstring.
    # Overflow: fields above the max's; underflow: nonzero (fields 1..254) less those above the
    # underflow threshold; subnormal: above the underflow threshold less those at or above the
    # subnormal limit (ab: the counts at or above the threshold within its own field).
    pos = (_span(f, 0, 1, Row.ZEROS)
           | _span(f, FLD_E4M3_MAX + 1, 256, Row.E4M3_OVERFLOW)
           | _span(f, 1, 255, Row.E4M3_UNDERFLOW)
           | _span(f, FLD_E4M3_UNDER + 1, 256, Row.E4M3_SUBNORMAL)
           | _span(f, FLD_MAXES + 1, 255, Row.E5M2_OVERFLOW)
           | _span(f, 1, 255, Row.E5M2_UNDERFLOW)
           | _span(f, FLD_E5M2_UNDER + 1, 256, Row.E5M2_SUBNORMAL)
           | _span(f, FLD_MAXES + 1, 255, Row.FP16_OVERFLOW)
           | _span(f, 1, 255, Row.FP16_UNDERFLOW)
           | _span(f, FLD_FP16_UNDER + 1, 256, Row.FP16_SUBNORMAL)
           | _span(f, FLD_MAXES, FLD_MAXES + 1, NOT_EXACT)
           | _span(f, FLD_BIG, 256, NOT_EXACT))
    neg = (_span(f, FLD_E4M3_UNDER + 1, 256, Row.E4M3_UNDERFLOW)
           | _span(f, FLD_E4M3_NORMAL + 1, 256, Row.E4M3_SUBNORMAL)
           | _span(f, FLD_E5M2_UNDER + 1, 256, Row.E5M2_UNDERFLOW)
           | _span(f, FLD_E5M2_NORMAL + 1, 256, Row.E5M2_SUBNORMAL)
           | _span(f, FLD_FP16_UNDER + 1, 256, Row.FP16_UNDERFLOW))
    if ENC != Enc.FLOAT:  # bf16 and fp8: fp16's subnormal limit from the fields (docstring)
        neg = neg | _span(f, FLD_E5M2_NORMAL + 1, 256, Row.FP16_SUBNORMAL)
    apos = (_span(f, FLD_E4M3_MAX, FLD_E4M3_MAX + 1, Row.E4M3_OVERFLOW)
            | _span(f, FLD_E4M3_UNDER, FLD_E4M3_UNDER + 1, Row.E4M3_SUBNORMAL)
            | _span(f, FLD_E5M2_UNDER, FLD_E5M2_UNDER + 1, Row.E5M2_SUBNORMAL)
            | _span(f, FLD_FP16_UNDER, FLD_FP16_UNDER + 1, Row.FP16_SUBNORMAL))
    aneg = (_span(f, FLD_E4M3_UNDER, FLD_E4M3_UNDER + 1, Row.E4M3_UNDERFLOW)
            | _span(f, FLD_E4M3_NORMAL, FLD_E4M3_NORMAL + 1, Row.E4M3_SUBNORMAL)
            | _span(f, FLD_E5M2_UNDER, FLD_E5M2_UNDER + 1, Row.E5M2_UNDERFLOW)
            | _span(f, FLD_E5M2_NORMAL, FLD_E5M2_NORMAL + 1, Row.E5M2_SUBNORMAL)
            | _span(f, FLD_FP16_UNDER, FLD_FP16_UNDER + 1, Row.FP16_UNDERFLOW))
    w = _bit_rows(pos) - _bit_rows(neg)
    wa = _bit_rows(apos) - _bit_rows(aneg)
    return tl.sum(w * h[None, :] + wa * ab[None, :], 1)


@triton.jit
def _words_tile(cur, mn, mx, um1, s1, s2, s2k, kp, bhi, h2, table, col, U: tl.constexpr,
                T: tl.constexpr, V: tl.constexpr, SUM32: tl.constexpr, LANE: tl.constexpr,
                PARTS: tl.constexpr):
    # one tile of bf16 read as 32-bit words (two values each) into the fast pass's accumulators;
    # on the GPU (LANE) mn and mx are bf16 pairs, both halves compared at once (_words_unpair)
    TILE: tl.constexpr = U * T * V
    w = tl.reshape(cur, [U, T, V // 2])
    lo = w << 16
    hi = w & -65536
    xl = lo.to(tl.float32, bitcast=True)
    xh = hi.to(tl.float32, bitcast=True)
    ul = lo & ABS_MASK
    uh = hi & ABS_MASK
    if LANE:
        mn = _bf16x2_min(mn, tl.reduce(tl.reduce(w, 2, _bf16x2_min), 0, _bf16x2_min))
        mx = _bf16x2_max(mx, tl.reduce(tl.reduce(w, 2, _bf16x2_max), 0, _bf16x2_max))
    else:
        mn = tl.minimum(mn, tl.minimum(_tmin(xl), _tmin(xh)))
        mx = tl.maximum(mx, tl.maximum(_tmax(xl), _tmax(xh)))
    if LANE:  # both halves at once: _words_um1
        k = (w & 0x7FFF7FFF) + 0x7FFF7FFF
        um1 = _s16x2_min(um1, tl.reduce(tl.reduce(k, 2, _s16x2_min), 0, _s16x2_min))
    else:
        um1 = tl.minimum(um1, tl.minimum(_tmin((ul - 1).to(tl.uint32, bitcast=True)),
                                         _tmin((uh - 1).to(tl.uint32, bitcast=True))))
    # The shifted sum of squares from the thread's tile sums, sum (x - kp)^2 = t2 - 2 kp t1 +
    # m kp^2 (m = U * V values), two float64 operations per 16 values instead of two per
    # value: this loop is bound by its shared-memory atomics and issue slots. t1 and t2 are
    # exact for bf16 values of similar magnitude (squares of 8-bit significands), so the result
    # is within ~1e-16 * m kp^2 per tile: the std keeps ~1e-16 (kp / std)^2 relative, 1e-8 at a
    # mean 10^4 times the std (the other passes take (x - kp)^2 per value)
    if SUM32:  # float32 within the tile (the squares of bf16 values are exact)
        t1 = (_tsum(xl) + _tsum(xh)).to(tl.float64)
        t2 = (_tsum(xl * xl) + _tsum(xh * xh)).to(tl.float64)
    else:
        l64 = xl.to(tl.float64)
        h64 = xh.to(tl.float64)
        t1 = _tsum(l64) + _tsum(h64)
        t2 = _tsum(l64 * l64) + _tsum(h64 * h64)
    s1 += t1
    s2 += t2
    s2k += (t2 - (2.0 * kp) * t1) + (U * V) * (kp * kp)
    if LANE:  # GPU
        bhi += _tsum(_halves_sum(w)).to(tl.int64)
    else:
        bhi += _tsum((w & 0xFFFF) + ((w >> 16) & 0xFFFF)).to(tl.int64)
    if (PART_HIST & PARTS) == 0:
        pass
    elif LANE and (PART_COUNTS & PARTS):  # every table load of the tile before its atomics
        al, tlo = _lane_thr_slot(w, col, _THR_SLOT_LO)
        ah, thi = _lane_thr_slot(w, col, _THR_SLOT_HI)
        vl = _thr_value(xl, tlo)
        vh = _thr_value(xh, thi)
        _lane_hist_add_at(al, vl)
        _lane_hist_add_at(ah, vh)
    elif LANE:
        _lane_hist_count(ul, table)
        _lane_hist_count(uh, table)
    else:
        h2 += tl.histogram(_thr_key(ul, TILE // 2), 512)
        h2 += tl.histogram(_thr_key(uh, TILE // 2), 512)
    return mn, mx, um1, s1, s2, s2k, bhi, h2


@triton.jit
def _words_um1(p):
    # The words' running min of |x| bits - 1 (zeros wrapping to the top), kept per bf16 half:
    # for a half v (15 bits, sign masked off), v + 0x7FFF stays below 2^16 (no carry into the
    # other half) and, read as a signed 16-bit number, orders like v - 1 with 0 above all (bit 15
    # set from v >= 1 on: -32768 + v - 1). Back to float32 bits: (m + 1) << 16, less 1.
    lo = (p & 0xFFFF) ^ 0x8000
    hi = ((p >> 16) & 0xFFFF) ^ 0x8000
    m = tl.minimum(lo, hi)
    return tl.where(m == 0xFFFF, -1, ((m + 1) << 16) - 1).to(tl.uint32, bitcast=True)


@triton.jit
def _words_unpair(p, LARGER: tl.constexpr):
    # a bf16 pair (an int32) to the smaller or larger of its two values, as float32
    a = (p << 16).to(tl.float32, bitcast=True)
    b = (p & -65536).to(tl.float32, bitcast=True)
    return tl.maximum(a, b) if LARGER else tl.minimum(a, b)


@triton.jit
def _values_tile(cur, mn, mx, um1, s1, s2, s2k, kp, blo, bhi, gt_f16_normal, h2, table, col,
                 ENC: tl.constexpr, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                 SUM32: tl.constexpr, LANE: tl.constexpr, PARTS: tl.constexpr):
    # one tile of float32 / fp16 / bf16 / fp8 values into the fast pass's accumulators
    TILE: tl.constexpr = U * T * V
    x, bits = _decode_tile(cur, ENC, U, T, V)
    u = bits & ABS_MASK
    mn = tl.minimum(mn, _tmin(x))
    mx = tl.maximum(mx, _tmax(x))
    um1 = tl.minimum(um1, _tmin((u - 1).to(tl.uint32, bitcast=True)))
    s1, s2, s2k, blo, bhi = _add_sums(x, bits, s1, s2, s2k, kp, blo, bhi, ENC, SUM32)
    if ENC == Enc.FLOAT and (PART_COUNTS & PARTS):  # float32 / fp16: fp16's subnormal limit
        gt_f16_normal += _tsum((u > FP16_NORMAL_BITS).to(tl.int32))
    if (PART_HIST & PARTS) == 0:
        pass
    elif LANE and (PART_COUNTS & PARTS):  # every table load of the tile before its atomics
        addr, t = _lane_thr_slot(bits, col, _THR_SLOT_HI)
        _lane_hist_add_at(addr, _thr_value(x, t))
    elif LANE:
        _lane_hist_count(u, table)
    else:
        h2 += tl.histogram(_thr_key(u, TILE), 512)
    return mn, mx, um1, s1, s2, s2k, blo, bhi, gt_f16_normal, h2


@triton.jit
def _fast_tiles(x_ptr, n_full, pid, nprog, lanes, kp, krow, ENC: tl.constexpr, U: tl.constexpr,
                T: tl.constexpr, V: tl.constexpr, LANE: tl.constexpr, WORDS: tl.constexpr,
                PREF: tl.constexpr, SUM32: tl.constexpr = False,
                PARTS: tl.constexpr = ALL_PARTS):
    # Returns (clean, the row's scalar fields as a 32-vector, the row's histogram); when clean is
    # 0 the other two are not to be used. LANE: the shared-memory lane histogram (GPU) instead
    # of tl.histogram. WORDS (bf16 at a 4-byte aligned address): two values per 32-bit word.
    # PREF (GPU): L2 prefetch, tiles ahead. SUM32, PARTS: timing only (kernels/_timing.py;
    # the row is wrong without ALL_PARTS): PART_COUNTS the threshold counts, PART_HIST the
    # histogram.
    TILE: tl.constexpr = U * T * V
    gt_f16_normal = tl.zeros([T], dtype=tl.int32)  # #(u > FP16_NORMAL_BITS), float32/fp16 only
    um1 = tl.full([T], 0xFFFFFFFF, tl.uint32)  # min of |x| bits - 1: zeros wrap to the top
    mn = tl.full([T], float("inf"), tl.float32)
    mx = tl.full([T], float("-inf"), tl.float32)
    s1 = tl.zeros([T], dtype=tl.float64)
    s2 = tl.zeros([T], dtype=tl.float64)
    s2k = tl.zeros([T], dtype=tl.float64)  # sum of (x - kp)^2: the shifted sums
    blo = tl.zeros([T], dtype=tl.int64)
    bhi = tl.zeros([T], dtype=tl.int64)
    f = tl.arange(0, 256)
    h2 = tl.zeros([512], dtype=tl.int32)
    if LANE:
        table = _lane_hist_init_with(pid * 0, _INIT_THR)  # and the threshold table
        col = _lane_col(pid * 0)
        tl.debug_barrier()
    else:
        table = pid * 0
        col = table
    step = nprog * TILE
    last = n_full - TILE
    if WORDS:  # bf16 read as 32-bit words, two values each
        TW: tl.constexpr = TILE // 2
        if LANE:  # bf16 pairs: +inf, +inf and -inf, -inf; um1 as 16-bit pairs (_words_um1)
            mn = tl.full([T], 0x7F807F80, tl.int32)
            mx = tl.full([T], -8323200, tl.int32)  # 0xFF80FF80
            um1 = tl.full([T], 0x7FFF7FFF, tl.int32)
        wp = x_ptr.to(tl.pointer_type(tl.int32))
        wl = tl.arange(0, TW)
        # Two tiles at a time, a and b: a's next load goes into a's registers once a is reduced
        # and lands while b is (one tile in flight, as before, without the copy of a prefetched
        # tile into the working registers that a one-tile loop needs: 8 moves per tile)
        a = tl.load(wp + tl.multiple_of(tl.minimum(pid * TILE, last) // 2, TW) + wl)
        b = tl.load(wp + tl.multiple_of(tl.minimum(pid * TILE + step, last) // 2, TW) + wl)
        for start in range(pid * TILE, n_full, 2 * step):
            if PREF:
                _l2_prefetch(x_ptr + tl.minimum(start + PREF * step, last), TILE * 2)
            mn, mx, um1, s1, s2, s2k, bhi, h2 = _words_tile(
                a, mn, mx, um1, s1, s2, s2k, kp, bhi, h2, table, col, U, T, V, SUM32, LANE,
                PARTS)
            a = tl.load(wp + tl.multiple_of(tl.minimum(start + 2 * step, last) // 2, TW) + wl)
            if start + step < n_full:
                if PREF:
                    _l2_prefetch(x_ptr + tl.minimum(start + (PREF + 1) * step, last), TILE * 2)
                mn, mx, um1, s1, s2, s2k, bhi, h2 = _words_tile(
                    b, mn, mx, um1, s1, s2, s2k, kp, bhi, h2, table, col, U, T, V, SUM32, LANE,
                    PARTS)
            b = tl.load(wp + tl.multiple_of(tl.minimum(start + 3 * step, last) // 2, TW) + wl)
        if LANE:
            mn = _words_unpair(mn, False)
            mx = _words_unpair(mx, True)
            um1 = _words_um1(um1)
    else:
        nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(pid * TILE, last), TILE) + lanes)
        for start in range(pid * TILE, n_full, step):
            cur = nxt
            nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(start + step, last), TILE) + lanes)
            if PREF:
                _l2_prefetch(x_ptr + tl.minimum(start + PREF * step, last),
                             TILE * (x_ptr.dtype.element_ty.primitive_bitwidth // 8))
            mn, mx, um1, s1, s2, s2k, blo, bhi, gt_f16_normal, h2 = _values_tile(
                cur, mn, mx, um1, s1, s2, s2k, kp, blo, bhi, gt_f16_normal, h2, table, col, ENC,
                U, T, V, SUM32, LANE, PARTS)
    if LANE:
        tl.debug_barrier()
        h, ab = _lane_hist_read2(f)
        h, ab = _top_rows(h, ab, f)
    else:
        hh = tl.reshape(h2, [2, 256])
        row = tl.reshape(tl.arange(0, 512) // 256, [2, 256])
        h = tl.sum(hh, 0)
        ab = tl.sum(tl.where(row == 1, hh, 0), 0)
    # every reduction below is block-wide (a barrier and a shared-memory round trip, in a chain
    # the program ends on): one for the scalars, one for all the counts, one for the flag
    lo_mn, hi_mx, m1, s1t, s2t, blot, bhit, gt_f16_normal_t, s2kt = tl.reduce(
        (mn, mx, um1, s1, s2, blo, bhi, gt_f16_normal, s2k), 0, _fold)
    cnt = _hist_counts(h, ab, f, ENC)
    idx = tl.arange(0, 32)
    clean = (tl.sum(tl.where(idx == NOT_EXACT, cnt, 0), 0) == 0) & (m1 >= 0x7FFFFF)
    # the fields cnt fills
    counted = (idx == Row.ZEROS) | ((idx >= Row.E4M3_OVERFLOW) & (idx < Row.FP16_SUBNORMAL + 1))
    v = tl.where(counted, cnt.to(tl.float64), 0.0)
    v = _put(v, idx, Row.NUMEL, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, Row.MIN, lo_mn)
    v = _put(v, idx, Row.MAX, hi_mx)
    v = _put(v, idx, Row.ABSMAX, tl.maximum(-lo_mn, hi_mx))
    v = _put(v, idx, Row.ABSMIN_NZ, tl.where(m1 == 0xFFFFFFFF, float("inf"),
                                             (m1 + 1).to(tl.float32, bitcast=True)))
    v = _put(v, idx, Row.SUM, s1t)
    v = _put(v, idx, Row.SUMSQ, s2t)
    # every value is finite here (else the careful pass runs): the program's count is what it read
    mine = tl.cdiv(tl.maximum(n_full - pid * TILE, 0), nprog * TILE) * TILE
    v = _at_row_shift(v, idx, s1t, s2kt, mine, kp, krow)
    if ENC == Enc.FLOAT:  # fp16's subnormal limit, counted element by element
        v = tl.where(idx == Row.FP16_SUBNORMAL, v - gt_f16_normal_t.to(tl.float64), v)
    v = _put(v, idx, Row.BITS_LO, blot)
    v = _put(v, idx, Row.BITS_HI, bhit)
    # row bin b holds exponent field b + 31; bin 0 also fields 1..30, bin 127 fields 159..254
    b = tl.arange(0, HBINS)
    cum = tl.cumsum(h, 0)
    top = tl.where(b == HBINS - 1, 254, b + 31)
    below = tl.where(b == 0, 0, b + 30)
    hist = tl.gather(cum, top, 0) - tl.gather(cum, below, 0)
    return clean.to(tl.int32), v, hist
