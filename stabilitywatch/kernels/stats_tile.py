"""Statistics kernel for the full tiles of a large tensor (the tail goes to the general kernel in
stats_triton.py; both merge into the same row with atomics). The kernel takes one of three
passes over its tiles: the fast pass (tile_fast.py, unscaled tensors), the fp8 byte-count pass
(tile_fp8.py), or the careful pass below (scaled tensors, and programs whose data the fast pass
cannot count exactly).

Why this shape: ~20 accumulators as [BLOCK] vectors (8 registers each per thread) compile to 255
registers per thread and leave too few warps to keep HBM busy (docs/kernels.md). Here each thread
reads a [U, V] piece of a [U, T, V] tile (U loads of 16 bytes), reduces it in its own
registers and keeps one register per accumulator; the next tile is loaded while this one is
reduced (80-128 registers, no spills: benchmarks/kernel_resources.py).

In the careful pass, per tile, the program also takes the tile's largest and smallest nonzero |x|
(two block-wide reductions) and uses them for uniform branches:
- NaN/Inf handling runs only in tiles that hold one;
- a format threshold is compared element by element only in tiles whose range straddles it
  (tiles entirely above it add their nonzero count, tiles below it add nothing);
- the exponent histogram: on the GPU a warp-level vote over the program's 64-bin window
  (_ballot_hist64), fixed from its first tile; elsewhere, and for tiles reaching outside that
  window, tl.histogram over a 32- or 64-bin window at the tile's own range, or all 128 bins.
All compares work on the float32 bit pattern u = bits & 0x7fffffff, whose integer order is the
order of |x|. Counts, extrema, histogram and fingerprint are exact; sums are float64 per tile.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import (ABS_MASK, ALL_PARTS, CANONICAL_NAN, E4M3_MAX_BITS, E4M3_NORMAL_BITS,
                        E4M3_UNDERFLOW_BITS, E5M2_MAX_BITS, E5M2_NORMAL_BITS,
                        E5M2_UNDERFLOW_BITS, FP16_MAX_BITS, FP16_NORMAL_BITS,
                        FP16_UNDERFLOW_BITS, HBINS, INF_BITS, NEG_INF_BITS, PART_COUNTS, PART_HIST,
                        Enc, Fast, Row)
from .launch import FastLaunch
from .ptx import _ballot_hist64, _l2_prefetch
from .row_ops import (_at_row_shift, _claim_shift, _decode_fp8, _emit_scalars, _load_shift, _put,
                      _sane_scale)
from .tile_fast import _fast_tiles
from .tile_fp8 import _fp8_tiles
from .tile_ops import _add_sums, _decode_tile, _tmax, _tmin, _tsum


@triton.jit
def _count_gt(yu, T: tl.constexpr, ymin, ymax, nz_t, c):
    # nz_t: this thread's count of nonzero lanes in the tile (a zero never exceeds T)
    if ymin > T:
        c += nz_t
    elif ymax > T:
        c += _tsum((yu > T).to(tl.int32))
    return c


@triton.jit
def _hist_window(u, valid, lo, NB: tl.constexpr, bins, TILE: tl.constexpr):
    # bins lo .. lo+NB-1 of the 128-bin histogram, from a histogram over NB bins
    h = tl.histogram(tl.reshape(tl.where(valid, (u >> 23) - (31 + lo), 0), [TILE]), NB,
                     mask=tl.reshape(valid, [TILE]))
    rel = bins - lo
    inwin = (rel >= 0) & (rel < NB)
    return tl.where(inwin, tl.gather(h, tl.where(inwin, rel, 0), 0), 0)


@triton.jit
def _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp, krow, ENC: tl.constexpr,
                   SCALED: tl.constexpr, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                   BALLOT: tl.constexpr, PREF: tl.constexpr, SUM32: tl.constexpr = False,
                   PARTS: tl.constexpr = ALL_PARTS):
    # Every case (NaN/Inf, scaled thresholds, float32 subnormals): the row's scalar fields as a
    # 32-vector, the histogram, and the ballot histogram's per-lane counts and window. SUM32,
    # PARTS: timing only (kernels/_timing.py; the row is wrong without ALL_PARTS): PART_COUNTS
    # the format counts, PART_HIST the histogram.
    TILE: tl.constexpr = U * T * V
    bins = tl.arange(0, HBINS)
    zt = tl.zeros([T], dtype=tl.int32)
    nzall = zt    # nonzero lanes, NaN/Inf included
    # per format, #(u > *_MAX_BITS), #(u > *_UNDERFLOW_BITS), #(u > *_NORMAL_BITS)
    gt_e4_max, gt_e5_max, gt_f16_max = zt, zt, zt
    gt_e4_under, gt_e5_under, gt_f16_under = zt, zt, zt
    gt_e4_normal, gt_e5_normal, gt_f16_normal = zt, zt, zt
    amx = tl.full([T], -1, tl.int32)
    amn = tl.full([T], ABS_MASK, tl.int32)
    mn = tl.full([T], float("inf"), tl.float32)
    mx = tl.full([T], float("-inf"), tl.float32)
    s1 = tl.zeros([T], dtype=tl.float64)
    s2 = tl.zeros([T], dtype=tl.float64)
    s2k = tl.zeros([T], dtype=tl.float64)
    blo = tl.zeros([T], dtype=tl.int64)
    bhi = tl.zeros([T], dtype=tl.int64)
    hist = tl.zeros([HBINS], dtype=tl.int32)
    z0 = pid * 0
    c_nan, c_pinf, c_ninf = z0, z0, z0
    # the next tile is loaded while this one is reduced (its bytes stay packed in registers);
    # past the end, the last tile is read again and not used
    step = nprog * TILE
    last = n_full - TILE
    nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(pid * TILE, last), TILE) + lanes)
    # BALLOT: this program's 64-bin window of exponent fields, E0 .. E0+63, from its first tile
    # (room for values 2^8 times larger and 2^55 times smaller); inside [31, 158], where no bin
    # is clamped. Tiles reaching outside it use tl.histogram over all 128 bins.
    e0 = pid * 0 + 31
    if BALLOT:
        if ENC == Enc.FLOAT:
            top = tl.max(nxt.to(tl.float32).to(tl.int32, bitcast=True) & ABS_MASK, 0)
        elif ENC == Enc.BF16:
            top = tl.max((nxt.to(tl.int32) << 16) & ABS_MASK, 0)
        else:
            top = tl.max(_decode_fp8(nxt.to(tl.int32), ENC == Enc.E5M2).to(tl.int32,
                                                                             bitcast=True)
                         & ABS_MASK, 0)
        e0 = tl.minimum(tl.maximum((top >> 23) - 55, 31), 95)
    hc0 = zt  # lane L of each warp: count of bin (e0 - 31 + L) ...
    hc1 = zt  # ... and of bin (e0 - 31 + L + 32)
    for start in range(pid * TILE, n_full, step):
        cur = nxt
        nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(start + step, last), TILE) + lanes)
        if PREF:
            _l2_prefetch(x_ptr + tl.minimum(start + PREF * step, last),
                         TILE * (x_ptr.dtype.element_ty.primitive_bitwidth // 8))
        x, bits = _decode_tile(cur, ENC, U, T, V)
        u = bits & ABS_MASK
        nz = u != 0
        nz_t = _tsum(nz.to(tl.int32))
        nzall += nz_t
        umax_t = _tmax(u)
        tmax = tl.max(umax_t, 0)
        if tmax >= INF_BITS:  # rare: NaN or Inf in this tile
            fin = u < INF_BITS
            c_nan += tl.sum(_tsum((u > INF_BITS).to(tl.int32)), 0)
            c_pinf += tl.sum(_tsum((bits == INF_BITS).to(tl.int32)), 0)
            c_ninf += tl.sum(_tsum((bits == NEG_INF_BITS).to(tl.int32)), 0)
            valid = nz & fin
            xf = tl.where(fin, x, 0.0)
            kf = tl.where(fin, kp, 0.0)  # zeroed values add nothing to the shifted sum either
            mn = tl.minimum(mn, _tmin(tl.where(fin, x, float("inf"))))
            mx = tl.maximum(mx, _tmax(tl.where(fin, x, float("-inf"))))
            amx = tl.maximum(amx, _tmax(tl.where(fin, u, -1)))
            fbits = tl.where(u > INF_BITS, CANONICAL_NAN, bits)  # as in the reference
            hmax = tl.max(_tmax(tl.where(fin, u, 0)), 0)
        else:
            valid = nz
            xf = x
            kf = tl.zeros([U, T, V], dtype=tl.float64) + kp  # a splat: no work per element
            mn = tl.minimum(mn, _tmin(x))
            mx = tl.maximum(mx, _tmax(x))
            amx = tl.maximum(amx, umax_t)
            fbits = bits
            hmax = tmax
        unz_t = _tmin(tl.where(valid, u, ABS_MASK))
        amn = tl.minimum(amn, unz_t)
        tmin = tl.min(unz_t, 0)
        s1, s2, s2k, blo, bhi = _add_sums(xf, fbits, s1, s2, s2k, kf, blo, bhi, ENC, SUM32)
        # format thresholds on y = |x * scale| (u itself when the scale is 1)
        if SCALED:
            # zeros stay out of every count: at scale +inf, 0 * inf is NaN, whose bits would
            # pass every threshold
            yu = tl.where(nz, (tl.abs(x * scale)).to(tl.int32, bitcast=True) & ABS_MASK, 0)
            ymin = tl.min(_tmin(tl.where(nz, yu, ABS_MASK)), 0)
            ymax = tl.max(_tmax(yu), 0)
        else:
            yu = u
            ymin = tmin
            ymax = tmax
        if PART_COUNTS & PARTS:
            gt_e4_max = _count_gt(yu, E4M3_MAX_BITS, ymin, ymax, nz_t, gt_e4_max)
            gt_e5_max = _count_gt(yu, E5M2_MAX_BITS, ymin, ymax, nz_t, gt_e5_max)
            gt_f16_max = _count_gt(yu, FP16_MAX_BITS, ymin, ymax, nz_t, gt_f16_max)
            gt_e4_under = _count_gt(yu, E4M3_UNDERFLOW_BITS, ymin, ymax, nz_t, gt_e4_under)
            gt_e5_under = _count_gt(yu, E5M2_UNDERFLOW_BITS, ymin, ymax, nz_t, gt_e5_under)
            gt_f16_under = _count_gt(yu, FP16_UNDERFLOW_BITS, ymin, ymax, nz_t, gt_f16_under)
            gt_e4_normal = _count_gt(yu, E4M3_NORMAL_BITS, ymin, ymax, nz_t, gt_e4_normal)
            gt_e5_normal = _count_gt(yu, E5M2_NORMAL_BITS, ymin, ymax, nz_t, gt_e5_normal)
            gt_f16_normal = _count_gt(yu, FP16_NORMAL_BITS, ymin, ymax, nz_t, gt_f16_normal)
        # exponent histogram of finite nonzero |x|; windows only where no bin is clamped
        elo = tmin >> 23
        ehi = hmax >> 23
        if not (PART_HIST & PARTS):
            pass
        elif (elo >= e0) & (ehi < e0 + 64) & (z0 + BALLOT > 0):
            ps = _tsum(_ballot_hist64(tl.where(valid, (u >> 23) - e0, 64)))
            hc0 += ps & 0xFFFF
            hc1 += ps >> 16
        elif (elo >= 31) & (ehi - 31 < HBINS) & (ehi - elo < 32):
            hist += _hist_window(u, valid, elo - 31, 32, bins, TILE)
        elif (elo >= 31) & (ehi - 31 < HBINS) & (ehi - elo < 64):
            hist += _hist_window(u, valid, elo - 31, 64, bins, TILE)
        elif tmin != ABS_MASK:
            b = tl.minimum(tl.maximum((u >> 23) - 31, 0), HBINS - 1)
            hist += tl.histogram(tl.reshape(tl.where(valid, b, 0), [TILE]), HBINS,
                                 mask=tl.reshape(valid, [TILE]))

    nonfin = c_nan + c_pinf + c_ninf
    mine = tl.cdiv(tl.maximum(n_full - pid * TILE, 0), nprog * TILE) * TILE  # lanes I read
    nza = tl.sum(nzall, 0)
    am = tl.max(amx, 0)
    an = tl.min(amn, 0)
    # overflow = #(y > max) among finite x; underflow = nonzero finite x minus #(y > half-sub);
    # subnormal = #(y > half-sub) - #(y >= subnormal limit). NaN/Inf x have y above every
    # threshold, so they are taken out of each count.
    nzf = nza - nonfin
    fin_gt_e4_under = tl.sum(gt_e4_under, 0) - nonfin
    fin_gt_e5_under = tl.sum(gt_e5_under, 0) - nonfin
    fin_gt_f16_under = tl.sum(gt_f16_under, 0) - nonfin
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, Row.NUMEL, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, Row.NAN, c_nan)
    v = _put(v, idx, Row.POSINF, c_pinf)
    v = _put(v, idx, Row.NEGINF, c_ninf)
    v = _put(v, idx, Row.ZEROS, mine - nza)
    v = _put(v, idx, Row.MIN, tl.min(mn, 0))
    v = _put(v, idx, Row.MAX, tl.max(mx, 0))
    v = _put(v, idx, Row.ABSMAX, tl.where(am < 0, float("-inf"), am.to(tl.float32, bitcast=True)))
    v = _put(v, idx, Row.ABSMIN_NZ, tl.where(an == ABS_MASK, float("inf"),
                                             an.to(tl.float32, bitcast=True)))
    s1t = tl.sum(s1, 0)
    v = _put(v, idx, Row.SUM, s1t)
    v = _put(v, idx, Row.SUMSQ, tl.sum(s2, 0))
    v = _at_row_shift(v, idx, s1t, tl.sum(s2k, 0), mine - nonfin, kp, krow)
    v = _put(v, idx, Row.E4M3_OVERFLOW, tl.sum(gt_e4_max, 0) - nonfin)
    v = _put(v, idx, Row.E4M3_UNDERFLOW, nzf - fin_gt_e4_under)
    v = _put(v, idx, Row.E4M3_SUBNORMAL, fin_gt_e4_under - tl.sum(gt_e4_normal, 0) + nonfin)
    v = _put(v, idx, Row.E5M2_OVERFLOW, tl.sum(gt_e5_max, 0) - nonfin)
    v = _put(v, idx, Row.E5M2_UNDERFLOW, nzf - fin_gt_e5_under)
    v = _put(v, idx, Row.E5M2_SUBNORMAL, fin_gt_e5_under - tl.sum(gt_e5_normal, 0) + nonfin)
    v = _put(v, idx, Row.FP16_OVERFLOW, tl.sum(gt_f16_max, 0) - nonfin)
    v = _put(v, idx, Row.FP16_UNDERFLOW, nzf - fin_gt_f16_under)
    v = _put(v, idx, Row.FP16_SUBNORMAL, fin_gt_f16_under - tl.sum(gt_f16_normal, 0) + nonfin)
    v = _put(v, idx, Row.BITS_LO, tl.sum(blo, 0))
    v = _put(v, idx, Row.BITS_HI, tl.sum(bhi, 0))
    return v, hist, hc0, hc1, e0


@triton.jit
def _tile_passes(x_ptr, out_ptr, scale_ptr, scale_val, n_full, ENC: tl.constexpr,
                 SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr, U: tl.constexpr,
                 T: tl.constexpr, V: tl.constexpr, BALLOT: tl.constexpr, FAST: tl.constexpr,
                 WORDS: tl.constexpr, BYTES: tl.constexpr, PREF: tl.constexpr,
                 WIDE: tl.constexpr, SUM32: tl.constexpr, CAREFUL_PARTS: tl.constexpr,
                 FAST_PARTS: tl.constexpr):
    # The tile kernel up to its row merge: the row's scalar fields as a 32-vector, its
    # histogram, and the careful pass's warp-vote counts and window (its own atomics). SUM32 and
    # the *_PARTS: timing only (kernels/_timing.py).
    if WIDE:
        n_full = n_full.to(tl.int64)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    TILE: tl.constexpr = U * T * V
    if HAS_SCALE_PTR:
        scale = _sane_scale(tl.load(scale_ptr).to(tl.float32))
    else:
        scale = scale_val
    # the shift: the tensor's first element, the row's when it already has one (tile launches
    # start at element 0)
    kp = _load_shift(x_ptr, ENC)
    krow = _claim_shift(out_ptr, kp)
    lanes = tl.arange(0, TILE)
    LANE: tl.constexpr = FAST == Fast.LANE_HISTOGRAM
    if FAST and BYTES and (ENC == Enc.E4M3 or ENC == Enc.E5M2):  # fp8: by byte value counts
        v, hist = _fp8_tiles(x_ptr, scale, n_full, pid, nprog, lanes, krow, ENC, U, T, V,
                             LANE, PREF, FAST_PARTS)
        hc0 = tl.zeros([T], dtype=tl.int32)
        hc1 = hc0
        e0 = pid * 0 + 31
    elif FAST:
        clean, v, hist = _fast_tiles(x_ptr, n_full, pid, nprog, lanes, kp, krow, ENC, U, T, V,
                                     LANE, WORDS, PREF, SUM32, FAST_PARTS)
        hc0 = tl.zeros([T], dtype=tl.int32)
        hc1 = hc0
        e0 = pid * 0 + 31
        if clean == 0:
            v, hist, hc0, hc1, e0 = _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp,
                                                   krow, ENC, SCALED, U, T, V, False, PREF,
                                                   SUM32, CAREFUL_PARTS)
    else:
        v, hist, hc0, hc1, e0 = _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp,
                                               krow, ENC, SCALED, U, T, V, BALLOT, PREF, SUM32,
                                               CAREFUL_PARTS)
    return v, hist, hc0, hc1, e0


@triton.jit
def _merge_tile_row(out_ptr, v, hist, hc0, hc1, e0, T: tl.constexpr, BALLOT: tl.constexpr,
                    FAST: tl.constexpr):
    idx = tl.arange(0, 32)
    _emit_scalars(out_ptr, idx, v)
    bins = tl.arange(0, HBINS)
    # empty bins are skipped: most of a row's atomics otherwise, serialized on the row
    tl.atomic_add(out_ptr + Row.HIST + bins, hist.to(tl.float64), mask=hist != 0,
                  sem="relaxed")
    if BALLOT and not FAST:
        lane = tl.arange(0, T) % 32
        tl.atomic_add(out_ptr + Row.HIST + (e0 - 31) + lane, hc0.to(tl.float64), mask=hc0 != 0,
                      sem="relaxed")
        tl.atomic_add(out_ptr + Row.HIST + (e0 - 31) + 32 + lane, hc1.to(tl.float64),
                      mask=hc1 != 0, sem="relaxed")


@triton.jit(do_not_specialize=["n_full"])
def _tile_stats_kernel(x_ptr, out_ptr, scale_ptr, scale_val, n_full,
                       ENC: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
                       U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                       BALLOT: tl.constexpr, FAST: tl.constexpr, WORDS: tl.constexpr,
                       BYTES: tl.constexpr, PREF: tl.constexpr, WIDE: tl.constexpr):
    # The statistics of x's n_full elements (whole [U, T, V] tiles, constants.Encoding ENC)
    # merged into the row at out_ptr. FAST (constants.FastPass): the fast pass (tile_fast.py)
    # for unscaled tensors, and a program whose data needs it runs the careful pass instead;
    # OFF: the careful pass only. BYTES (fp8): the byte-count pass (tile_fp8.py). BALLOT (GPU,
    # careful pass): the histogram by warp vote. WORDS (bf16): two values per 32-bit load.
    # PREF (GPU only): each loop asks for the tile PREF tiles ahead into L2 (ptx._l2_prefetch).
    # WIDE: element offsets in int64, for an n_full that Triton passes as int32 (below 2^31) but
    # that the loops' offsets, up to ~10 grid steps beyond a tile, would take past it.
    v, hist, hc0, hc1, e0 = _tile_passes(x_ptr, out_ptr, scale_ptr, scale_val, n_full, ENC,
                                         SCALED, HAS_SCALE_PTR, U, T, V, BALLOT, FAST, WORDS,
                                         BYTES, PREF, WIDE, False, ALL_PARTS, ALL_PARTS)
    _merge_tile_row(out_ptr, v, hist, hc0, hc1, e0, T, BALLOT, FAST)


_launch = FastLaunch(_tile_stats_kernel)
