"""The tile kernel's fast pass: no per-tile block-wide reductions and no branches, for the usual
case of finite values and scale 1.

Per element it keeps running extrema, float64 sums, the fingerprint, seven threshold counts
(E4M3 max, the three underflow thresholds and the three subnormal limits; bf16 compares two
values per 32-bit word, _words_above) and one count in a 256-bin histogram of the float32
exponent field of |x| (zeros in bin 0, Inf/NaN in bin 255). The rest comes from that histogram once, at
the end: zeros, the nonzero count (hence underflow = nonzero - #(u > threshold)), the E5M2 and
fp16 overflow counts, and the row's 128 bins.

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

from .ptx import _lane_hist_count, _lane_hist_init, _lane_hist_read
from .tile_ops import (HBINS, O_E4, O_E5, O_F16, O_HIST, TH4, TH5, TH6, TM4, TM5, TM6, TS4,
                       TS5, TS6, _add_sums, _decode_tile, _tmax, _tmin, _tsum)
from .stats_triton import _put


def _field(bits: int) -> int:
    return bits >> 23


assert _field(TM5.value) == _field(TM6.value) == 142 and _field(TM4.value) < 142
F_MAXBIN = tl.constexpr(142)  # [2^15, 2^16): holds the E5M2 and fp16 maxima
F_BIG = tl.constexpr(127 + 60)  # |x| >= 2^60


@triton.jit
def _between(h, f, lo, hi):
    # sum of h over exponent fields lo <= f < hi
    return tl.sum(tl.where((f >= lo) & (f < hi), h, 0), 0)


def _word_key(t: int) -> int:
    # (t16 + 0x8000) in both 16-bit halves, as int32; t16 = t >> 16: for a bf16 value's float32
    # bits u (low half zero), u > t exactly when u >> 16 > t16
    k = ((t >> 16) + 0x8000) * 0x10001
    return k - (1 << 32) if k >= 1 << 31 else k


KM4, KH4, KH5, KH6 = (tl.constexpr(_word_key(TM4.value)), tl.constexpr(_word_key(TH4.value)),
                      tl.constexpr(_word_key(TH5.value)), tl.constexpr(_word_key(TH6.value)))
KS4, KS5, KS6 = (tl.constexpr(_word_key(TS4.value)), tl.constexpr(_word_key(TS5.value)),
                 tl.constexpr(_word_key(TS6.value)))


@triton.jit
def _words_above(a, K: tl.constexpr, N: tl.constexpr):
    # a: words of two |bf16| bit patterns (15 bits each); per thread, how many of its N values
    # are above the threshold. K - a leaves bit 15 of each half set where that half is not above
    # (no borrow crosses the halves): one subtraction compares two values.
    d = -(a - K)  # not K - a: the interpreter keeps constexpr - tensor a constexpr
    p = _tsum((d >> 15) & 0x10001)
    return N - (p & 0xFFFF) - ((p >> 16) & 0xFFFF)


@triton.jit
def _fast_tiles(x_ptr, n_full, pid, nprog, lanes, FP8: tl.constexpr, U: tl.constexpr,
                T: tl.constexpr, V: tl.constexpr, SUM32: tl.constexpr, LANE: tl.constexpr,
                WORDS: tl.constexpr = False, FPARTS: tl.constexpr = 3):
    # Returns (clean, the row's scalar fields as a 32-vector, the row's histogram); when clean is
    # 0 the other two are not to be used. LANE: the shared-memory lane histogram (GPU) instead
    # of tl.histogram. WORDS (bf16 at a 4-byte aligned address): two values per 32-bit word.
    # FPARTS (benchmarks only, timing what each part costs; the row is wrong without both):
    # bit 0 the threshold counts, bit 1 the histogram.
    TILE: tl.constexpr = U * T * V
    zt = tl.zeros([T], dtype=tl.int32)
    cm4, cs4, cs5, cs6, ch4, ch5, ch6 = zt, zt, zt, zt, zt, zt, zt
    um1 = tl.full([T], 0xFFFFFFFF, tl.uint32)  # min of |x| bits - 1: zeros wrap to the top
    mn = tl.full([T], float("inf"), tl.float32)
    mx = tl.full([T], float("-inf"), tl.float32)
    s1 = tl.zeros([T], dtype=tl.float64)
    s2 = tl.zeros([T], dtype=tl.float64)
    blo = tl.zeros([T], dtype=tl.int64)
    bhi = tl.zeros([T], dtype=tl.int64)
    f = tl.arange(0, 256)
    h = tl.zeros([256], dtype=tl.int32)
    if LANE:
        table = _lane_hist_init(pid * 0)
        tl.debug_barrier()
    step = nprog * TILE
    last = n_full - TILE
    if WORDS:  # bf16 read as 32-bit words, two values each (_words_above)
        TW: tl.constexpr = TILE // 2
        wp = x_ptr.to(tl.pointer_type(tl.int32))
        wl = tl.arange(0, TW)
        nxt = tl.load(wp + tl.multiple_of(tl.minimum(pid * TILE, last) // 2, TW) + wl)
        for start in range(pid * TILE, n_full, step):
            cur = nxt
            nxt = tl.load(wp + tl.multiple_of(tl.minimum(start + step, last) // 2, TW) + wl)
            w = tl.reshape(cur, [U, T, V // 2])
            lo = w << 16
            hi = w & -65536
            xl = lo.to(tl.float32, bitcast=True)
            xh = hi.to(tl.float32, bitcast=True)
            ul = lo & 0x7FFFFFFF
            uh = hi & 0x7FFFFFFF
            mn = tl.minimum(mn, tl.minimum(_tmin(xl), _tmin(xh)))
            mx = tl.maximum(mx, tl.maximum(_tmax(xl), _tmax(xh)))
            um1 = tl.minimum(um1, tl.minimum(_tmin((ul - 1).to(tl.uint32, bitcast=True)),
                                             _tmin((uh - 1).to(tl.uint32, bitcast=True))))
            if SUM32:  # float32 within the tile (the squares of bf16 values are exact)
                s1 += (_tsum(xl) + _tsum(xh)).to(tl.float64)
                s2 += (_tsum(xl * xl) + _tsum(xh * xh)).to(tl.float64)
            else:
                l64 = xl.to(tl.float64)
                h64 = xh.to(tl.float64)
                s1 += _tsum(l64) + _tsum(h64)
                s2 += _tsum(l64 * l64) + _tsum(h64 * h64)
            bhi += _tsum((w & 0xFFFF) + ((w >> 16) & 0xFFFF)).to(tl.int64)
            a = w & 0x7FFF7FFF
            if FPARTS & 1:
                cm4 += _words_above(a, KM4, U * V)
                ch4 += _words_above(a, KH4, U * V)
                ch5 += _words_above(a, KH5, U * V)
                ch6 += _words_above(a, KH6, U * V)
                cs4 += _words_above(a, KS4, U * V)
                cs5 += _words_above(a, KS5, U * V)
                cs6 += _words_above(a, KS6, U * V)
            if (FPARTS & 2) == 0:
                pass
            elif LANE:
                _lane_hist_count(ul, table)
                _lane_hist_count(uh, table)
            else:
                h += tl.histogram(tl.reshape(ul >> 23, [TILE // 2]), 256)
                h += tl.histogram(tl.reshape(uh >> 23, [TILE // 2]), 256)
    else:
        nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(pid * TILE, last), TILE) + lanes)
        for start in range(pid * TILE, n_full, step):
            cur = nxt
            nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(start + step, last), TILE) + lanes)
            x, bits = _decode_tile(cur, FP8, U, T, V)
            u = bits & 0x7FFFFFFF
            mn = tl.minimum(mn, _tmin(x))
            mx = tl.maximum(mx, _tmax(x))
            um1 = tl.minimum(um1, _tmin((u - 1).to(tl.uint32, bitcast=True)))
            s1, s2, blo, bhi = _add_sums(x, bits, s1, s2, blo, bhi, FP8, SUM32)
            if FPARTS & 1:
                cm4 += _tsum((u > TM4).to(tl.int32))
                ch4 += _tsum((u > TH4).to(tl.int32))
                ch5 += _tsum((u > TH5).to(tl.int32))
                ch6 += _tsum((u > TH6).to(tl.int32))
                cs4 += _tsum((u > TS4).to(tl.int32))
                cs5 += _tsum((u > TS5).to(tl.int32))
                cs6 += _tsum((u > TS6).to(tl.int32))
            if (FPARTS & 2) == 0:
                pass
            elif LANE:
                _lane_hist_count(u, table)
            else:
                h += tl.histogram(tl.reshape(u >> 23, [TILE]), 256)
    if LANE:
        tl.debug_barrier()
        h = _lane_hist_read(f)
    m1 = tl.min(um1, 0)
    clean = ((_between(h, f, F_MAXBIN, F_MAXBIN + 1) + _between(h, f, F_BIG, 256) == 0)
             & (m1 >= 0x7FFFFF))
    lo_mn = tl.min(mn, 0)
    hi_mx = tl.max(mx, 0)
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, 0, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, 4, _between(h, f, 0, 1))
    v = _put(v, idx, 5, lo_mn)
    v = _put(v, idx, 6, hi_mx)
    v = _put(v, idx, 7, tl.maximum(-lo_mn, hi_mx))
    v = _put(v, idx, 8, tl.where(m1 == 0xFFFFFFFF, float("inf"),
                                 (m1 + 1).to(tl.float32, bitcast=True)))
    v = _put(v, idx, 9, tl.sum(s1, 0))
    v = _put(v, idx, 10, tl.sum(s2, 0))
    over = _between(h, f, F_MAXBIN + 1, 255)
    v = _put(v, idx, O_E4 + 0, tl.sum(cm4, 0))
    nz = _between(h, f, 1, 255)
    g4, g5, g6 = tl.sum(ch4, 0), tl.sum(ch5, 0), tl.sum(ch6, 0)
    v = _put(v, idx, O_E4 + 1, nz - g4)
    v = _put(v, idx, O_E4 + 2, g4 - tl.sum(cs4, 0))
    v = _put(v, idx, O_E5 + 0, over)
    v = _put(v, idx, O_E5 + 1, nz - g5)
    v = _put(v, idx, O_E5 + 2, g5 - tl.sum(cs5, 0))
    v = _put(v, idx, O_F16 + 0, over)
    v = _put(v, idx, O_F16 + 1, nz - g6)
    v = _put(v, idx, O_F16 + 2, g6 - tl.sum(cs6, 0))
    v = _put(v, idx, O_HIST - 2, tl.sum(blo, 0))
    v = _put(v, idx, O_HIST - 1, tl.sum(bhi, 0))
    # row bin b holds exponent field b + 31; bin 0 also fields 1..30, bin 127 fields 159..254
    b = tl.arange(0, HBINS)
    cum = tl.cumsum(h, 0)
    top = tl.where(b == HBINS - 1, 254, b + 31)
    below = tl.where(b == 0, 0, b + 30)
    hist = tl.gather(cum, top, 0) - tl.gather(cum, below, 0)
    return clean.to(tl.int32), v, hist
