"""Statistics kernel for the full tiles of a large tensor (the tail goes to the general kernel in
stats_triton.py; both merge into the same row with atomics). The kernel takes one of three
passes over its tiles: the fast pass (tile_fast.py, unscaled tensors), the fp8 byte-count pass
(tile_fp8.py), or the careful pass below (scaled tensors, and programs whose data the fast pass
cannot count exactly).

Why this shape: an earlier kernel kept ~20 accumulators as [BLOCK] vectors (8 registers each per
thread), compiled to 255 registers per thread and left too few warps to keep HBM busy. Here each
thread reads a [U, V] piece of a [U, T, V] tile (U loads of 16 bytes), reduces it in its own
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

from .launch import FastLaunch
from .ptx import _ballot_hist64, _l2_prefetch
from .row_ops import (S_AMAX, S_AMIN, S_BHI, S_BLO, S_MAX, S_MIN, S_SUM, S_SUMSQ,
                      _at_row_shift, _claim_shift, _decode_fp8, _emit_scalars, _load_shift, _put,
                      _sane_scale)
from .tile_fast import _fast_tiles
from .tile_fp8 import _fp8_tiles
from .tile_ops import (HBINS, O_E4, O_E5, O_F16, O_HIST, TH4, TH5, TH6, TM4, TM5, TM6, TS4, TS5,
                       TS6, _INF, _MAXI, _NEGINF, _add_sums, _decode_tile, _tmax, _tmin,
                       _tsum)

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
def _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp, krow, FP8: tl.constexpr,
                   SCALED: tl.constexpr, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                   SUM32: tl.constexpr, PARTS: tl.constexpr, BALLOT: tl.constexpr,
                   PREF: tl.constexpr = 0):
    # Every case (NaN/Inf, scaled thresholds, float32 subnormals): the row's scalar fields as a
    # 32-vector, the histogram, and the ballot histogram's per-lane counts and window.
    TILE: tl.constexpr = U * T * V
    bins = tl.arange(0, HBINS)
    zt = tl.zeros([T], dtype=tl.int32)
    nzall = zt    # nonzero lanes, NaN/Inf included
    cm4, cm5, cm6, ch4, ch5, ch6, cs4, cs5, cs6 = zt, zt, zt, zt, zt, zt, zt, zt, zt
    amx = tl.full([T], -1, tl.int32)
    amn = tl.full([T], _MAXI, tl.int32)
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
        if FP8 == 0:
            top = tl.max(nxt.to(tl.float32).to(tl.int32, bitcast=True) & _MAXI, 0)
        elif FP8 == 3:
            top = tl.max((nxt.to(tl.int32) << 16) & _MAXI, 0)
        else:
            top = tl.max(_decode_fp8(nxt.to(tl.int32), FP8 == 2).to(tl.int32, bitcast=True)
                         & _MAXI, 0)
        e0 = tl.minimum(tl.maximum((top >> 23) - 55, 31), 95)
    hc0 = zt  # lane L of each warp: count of bin (e0 - 31 + L) ...
    hc1 = zt  # ... and of bin (e0 - 31 + L + 32)
    for start in range(pid * TILE, n_full, step):
        cur = nxt
        nxt = tl.load(x_ptr + tl.multiple_of(tl.minimum(start + step, last), TILE) + lanes)
        if PREF:
            _l2_prefetch(x_ptr + tl.minimum(start + PREF * step, last),
                         TILE * (x_ptr.dtype.element_ty.primitive_bitwidth // 8))
        x, bits = _decode_tile(cur, FP8, U, T, V)
        u = bits & _MAXI
        nz = u != 0
        nz_t = _tsum(nz.to(tl.int32))
        nzall += nz_t
        umax_t = _tmax(u)
        tmax = tl.max(umax_t, 0)
        if tmax >= _INF:  # rare: NaN or Inf in this tile
            fin = u < _INF
            c_nan += tl.sum(_tsum((u > _INF).to(tl.int32)), 0)
            c_pinf += tl.sum(_tsum((bits == _INF).to(tl.int32)), 0)
            c_ninf += tl.sum(_tsum((bits == _NEGINF).to(tl.int32)), 0)
            valid = nz & fin
            xf = tl.where(fin, x, 0.0)
            kf = tl.where(fin, kp, 0.0)  # zeroed values add nothing to the shifted sum either
            mn = tl.minimum(mn, _tmin(tl.where(fin, x, float("inf"))))
            mx = tl.maximum(mx, _tmax(tl.where(fin, x, float("-inf"))))
            amx = tl.maximum(amx, _tmax(tl.where(fin, u, -1)))
            fbits = tl.where(u > _INF, 0x7FC00000, bits)  # canonical NaN, as in the reference
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
        unz_t = _tmin(tl.where(valid, u, _MAXI))
        amn = tl.minimum(amn, unz_t)
        tmin = tl.min(unz_t, 0)
        s1, s2, s2k, blo, bhi = _add_sums(xf, fbits, s1, s2, s2k, kf, blo, bhi, FP8, SUM32)
        # format thresholds on y = |x * scale| (u itself when the scale is 1)
        if SCALED:
            # zeros stay out of every count: at scale +inf, 0 * inf is NaN, whose bits would
            # pass every threshold
            yu = tl.where(nz, (tl.abs(x * scale)).to(tl.int32, bitcast=True) & _MAXI, 0)
            ymin = tl.min(_tmin(tl.where(nz, yu, _MAXI)), 0)
            ymax = tl.max(_tmax(yu), 0)
        else:
            yu = u
            ymin = tmin
            ymax = tmax
        if PARTS & 1:
            cm4 = _count_gt(yu, TM4, ymin, ymax, nz_t, cm4)
            cm5 = _count_gt(yu, TM5, ymin, ymax, nz_t, cm5)
            cm6 = _count_gt(yu, TM6, ymin, ymax, nz_t, cm6)
            ch4 = _count_gt(yu, TH4, ymin, ymax, nz_t, ch4)
            ch5 = _count_gt(yu, TH5, ymin, ymax, nz_t, ch5)
            ch6 = _count_gt(yu, TH6, ymin, ymax, nz_t, ch6)
            cs4 = _count_gt(yu, TS4, ymin, ymax, nz_t, cs4)
            cs5 = _count_gt(yu, TS5, ymin, ymax, nz_t, cs5)
            cs6 = _count_gt(yu, TS6, ymin, ymax, nz_t, cs6)
        # exponent histogram of finite nonzero |x|; windows only where no bin is clamped
        elo = tmin >> 23
        ehi = hmax >> 23
        if not (PARTS & 2):
            pass
        elif (elo >= e0) & (ehi < e0 + 64) & (z0 + BALLOT > 0):
            ps = _tsum(_ballot_hist64(tl.where(valid, (u >> 23) - e0, 64)))
            hc0 += ps & 0xFFFF
            hc1 += ps >> 16
        elif (elo >= 31) & (ehi - 31 < HBINS) & (ehi - elo < 32):
            hist += _hist_window(u, valid, elo - 31, 32, bins, TILE)
        elif (elo >= 31) & (ehi - 31 < HBINS) & (ehi - elo < 64):
            hist += _hist_window(u, valid, elo - 31, 64, bins, TILE)
        elif tmin != _MAXI:
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
    g_h4 = tl.sum(ch4, 0) - nonfin
    g_h5 = tl.sum(ch5, 0) - nonfin
    g_h6 = tl.sum(ch6, 0) - nonfin
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, 0, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, 1, c_nan)
    v = _put(v, idx, 2, c_pinf)
    v = _put(v, idx, 3, c_ninf)
    v = _put(v, idx, 4, mine - nza)
    v = _put(v, idx, S_MIN, tl.min(mn, 0))
    v = _put(v, idx, S_MAX, tl.max(mx, 0))
    v = _put(v, idx, S_AMAX, tl.where(am < 0, float("-inf"), am.to(tl.float32, bitcast=True)))
    v = _put(v, idx, S_AMIN, tl.where(an == _MAXI, float("inf"),
                                      an.to(tl.float32, bitcast=True)))
    s1t = tl.sum(s1, 0)
    v = _put(v, idx, S_SUM, s1t)
    v = _put(v, idx, S_SUMSQ, tl.sum(s2, 0))
    v = _at_row_shift(v, idx, s1t, tl.sum(s2k, 0), mine - nonfin, kp, krow)
    v = _put(v, idx, O_E4 + 0, tl.sum(cm4, 0) - nonfin)
    v = _put(v, idx, O_E4 + 1, nzf - g_h4)
    v = _put(v, idx, O_E4 + 2, g_h4 - tl.sum(cs4, 0) + nonfin)
    v = _put(v, idx, O_E5 + 0, tl.sum(cm5, 0) - nonfin)
    v = _put(v, idx, O_E5 + 1, nzf - g_h5)
    v = _put(v, idx, O_E5 + 2, g_h5 - tl.sum(cs5, 0) + nonfin)
    v = _put(v, idx, O_F16 + 0, tl.sum(cm6, 0) - nonfin)
    v = _put(v, idx, O_F16 + 1, nzf - g_h6)
    v = _put(v, idx, O_F16 + 2, g_h6 - tl.sum(cs6, 0) + nonfin)
    v = _put(v, idx, S_BLO, tl.sum(blo, 0))
    v = _put(v, idx, S_BHI, tl.sum(bhi, 0))
    return v, hist, hc0, hc1, e0


@triton.jit(do_not_specialize=["n_full"])
def _tile_stats_kernel(x_ptr, out_ptr, scale_ptr, scale_val, n_full,
                       FP8: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
                       U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                       SUM32: tl.constexpr = False, PARTS: tl.constexpr = 3,
                       BALLOT: tl.constexpr = 0, FAST: tl.constexpr = 0,
                       WORDS: tl.constexpr = False, BYTES: tl.constexpr = False,
                       FPARTS: tl.constexpr = 3, PREF: tl.constexpr = 0,
                       WIDE: tl.constexpr = False):
    # PREF (GPU only): each loop asks for the tile PREF tiles ahead into L2 (ptx._l2_prefetch).
    # WIDE: element offsets in int64, for an n_full that Triton passes as int32 (below 2^31) but
    # that the loops' offsets, up to ~10 grid steps beyond a tile, would take past it.
    # PARTS, FPARTS (benchmarks only, to see where time goes; the row is wrong without all
    # parts): the careful pass's (1 = format counts, 2 = histogram) and the fast pass's (1 =
    # threshold counts, 2 = histogram); FPARTS 4: none of the row's atomics but the careful
    # pass's warp-vote bins (the row stays as it was after a fast pass).
    # FAST: 1 = the fast passes with tl.histogram, 2 = with the lane histogram in shared memory
    # (GPU). BYTES (fp8): the byte-count pass (tile_fp8.py); else, unscaled: the fast pass
    # (tile_fast.py), and a program whose data needs it runs the careful pass instead.
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
    kp = _load_shift(x_ptr, FP8)
    krow = _claim_shift(out_ptr, kp)
    lanes = tl.arange(0, TILE)
    if FAST and BYTES and (FP8 == 1 or FP8 == 2):  # fp8: from the count of each byte value
        v, hist = _fp8_tiles(x_ptr, scale, n_full, pid, nprog, lanes, krow, FP8, U, T, V,
                             FAST == 2, PREF, FPARTS)
        hc0 = tl.zeros([T], dtype=tl.int32)
        hc1 = hc0
        e0 = pid * 0 + 31
    elif FAST:
        clean, v, hist = _fast_tiles(x_ptr, n_full, pid, nprog, lanes, kp, krow, FP8, U, T, V,
                                     SUM32, FAST == 2, WORDS, FPARTS, PREF)
        hc0 = tl.zeros([T], dtype=tl.int32)
        hc1 = hc0
        e0 = pid * 0 + 31
        if clean == 0:
            v, hist, hc0, hc1, e0 = _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp,
                                                   krow, FP8, SCALED, U, T, V, SUM32, PARTS, 0,
                                                   PREF)
    else:
        v, hist, hc0, hc1, e0 = _careful_tiles(x_ptr, scale, n_full, pid, nprog, lanes, kp,
                                               krow, FP8, SCALED, U, T, V, SUM32, PARTS, BALLOT,
                                               PREF)
    idx = tl.arange(0, 32)
    if (FPARTS & 4) == 0:  # bit 2 (timing only): no atomics into the row
        _emit_scalars(out_ptr, idx, v)
        bins = tl.arange(0, HBINS)
        # empty bins are skipped: most of a row's atomics otherwise, serialized on the row
        tl.atomic_add(out_ptr + O_HIST + bins, hist.to(tl.float64), mask=hist != 0,
                      sem="relaxed")
    else:  # a store that never happens keeps the compiler from dropping the work
        keep = tl.sum(v, 0) + tl.sum(hist, 0).to(tl.float64)
        tl.store(out_ptr, keep, mask=keep == -1.2345e300)
    if BALLOT and not FAST:
        lane = tl.arange(0, T) % 32
        tl.atomic_add(out_ptr + O_HIST + (e0 - 31) + lane, hc0.to(tl.float64), mask=hc0 != 0,
                      sem="relaxed")
        tl.atomic_add(out_ptr + O_HIST + (e0 - 31) + 32 + lane, hc1.to(tl.float64),
                      mask=hc1 != 0, sem="relaxed")


def tile_shape(itemsize: int, interpreting: bool, num_warps: int = 4,
               u: "int | None" = None) -> tuple[int, int, int]:
    """(U, T, V): V elements per 16-byte load, T threads, U 16-byte loads per thread and tile."""
    v = 16 // itemsize
    if interpreting:  # few, wide programs; 8192-element tiles like the interpreter's blocks
        return 8192 // (256 * v), 256, v
    # two 16-byte loads per thread and tile for float32 and bf16, one for fp8: measured fastest
    # on the H200 (docs/kernels.md, "Loads, grid and registers")
    rows = u if isinstance(u, int) else 1 if v == 16 else 2
    return rows, 32 * num_warps, v


def tile_consts(aligned4: bool, has_ptr: bool, scaled: bool, fp8: int, shape: tuple,
                sum32: bool, parts: int, ballot: bool, fast: int, words: bool, bytes_: bool,
                maxnreg: "int | None", fparts: int, pref: int,
                wide: bool = False) -> tuple[dict, dict]:
    """The tile kernel's constexprs and compile options (aligned4: x starts 4-byte aligned).
    fast: 0 careful pass only, 1 fast pass with tl.histogram, 2 with the shared-memory lane
    histogram (GPU only). bytes_: fp8 through its byte-count pass (tile_fp8.py), also taken for
    scaled fp8; other scaled tensors take the careful pass."""
    u, t, v = shape
    bytes_ = bool(fast and fp8 in (1, 2) and (bytes_ or scaled))
    fast = 0 if scaled and not bytes_ else fast
    # bf16 two values per 32-bit load: needs a 4-byte aligned start
    words = bool(fast and fp8 == 3 and words and aligned4)
    consts = dict(FP8=fp8, SCALED=scaled, HAS_SCALE_PTR=has_ptr, U=u, T=t, V=v, SUM32=sum32,
                  PARTS=parts, BALLOT=int(ballot and not fast), FAST=fast, WORDS=words,
                  BYTES=bytes_, FPARTS=fparts, PREF=pref, WIDE=wide)
    # a register cap for the kernels with a fast pass (more programs per SM; their careful pass
    # runs under it too); the careful pass alone keeps what the compiler gives it
    opts = {} if maxnreg is None or not fast else {"maxnreg": maxnreg}
    return consts, opts


_launch = FastLaunch(_tile_stats_kernel)
