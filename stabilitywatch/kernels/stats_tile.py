"""Statistics kernel for the full tiles of a large tensor (the tail goes to the general kernel in
stats_triton.py; both merge into the same row with atomics).

Why this shape: an earlier kernel kept ~20 accumulators as [BLOCK] vectors (8 registers each per
thread), compiled to 255 registers per thread and left too few warps to keep HBM busy. Here each
thread reads a [U, V] piece of a [U, T, V] tile (U loads of 16 bytes), reduces it in its own
registers and keeps one register per accumulator; the next tile is loaded while this one is
reduced (80-128 registers, no spills: benchmarks/kernel_resources.py).

Per tile, the program also takes the tile's largest and smallest nonzero |x| (two block-wide
reductions) and uses them for uniform branches:
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

import struct

import triton
import triton.language as tl

from ..formats import FORMATS, Fmt
from ..stats.layout import FMT_BASE, HIST_BINS, HIST_EMIN, Stat
from .launch import FastLaunch
from .stats_triton import _decode_fp8

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


def _ballot_ptx() -> str:
    # %m: lanes with a valid bin; for each of bits 0-4, keep the lanes whose bit equals this
    # lane's (xor with (lane bit - 1) inverts the vote where the lane's bit is 0); bit 5 splits
    # the result into bin lane and bin lane + 32
    bit = """
        and.b32 %t, $1, {m};
        setp.ne.u32 %p, %t, 0;
        vote.sync.ballot.b32 %b, %p, -1;
        bfe.u32 %k, %l, {i}, 1;
        sub.u32 %k, %k, 1;
        xor.b32 %b, %b, %k;
        and.b32 %m, %m, %b;"""
    return ("""{
        .reg .pred %p;
        .reg .b32 %m, %b, %t, %l, %k;
        mov.u32 %l, %laneid;
        setp.lt.u32 %p, $1, 64;
        vote.sync.ballot.b32 %m, %p, -1;"""
            + "".join(bit.format(m=1 << i, i=i) for i in range(5))
            + """
        and.b32 %t, $1, 32;
        setp.ne.u32 %p, %t, 0;
        vote.sync.ballot.b32 %b, %p, -1;
        and.b32 %k, %m, %b;
        not.b32 %b, %b;
        and.b32 %t, %m, %b;
        popc.b32 %t, %t;
        popc.b32 %k, %k;
        shl.b32 %k, %k, 16;
        or.b32 $0, %t, %k;
        }""")


_BALLOT_PTX = tl.constexpr(_ballot_ptx())  # a global a @triton.jit function reads


@triton.jit
def _ballot_hist64(sel):
    # A warp-level histogram over 64 bins (sel in [0, 64); anything else is not counted), one
    # element slot at a time: the 32 lanes vote on each bit of their element's bin, lane L keeps
    # the lanes whose bits spell L (bin L) or L + 32 and counts them. Returns, per slot, bin L's
    # count | bin (L + 32)'s count << 16. No shared memory and no atomics: tl.histogram's
    # shared-memory atomics serialize on the few bins a tensor's exponents fall in. GPU only
    # (the interpreter cannot run PTX); every lane of the warp must reach it (uniform code).
    return tl.inline_asm_elementwise(
        asm=_BALLOT_PTX,
        constraints="=r,r", args=[sel], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit(do_not_specialize=["n_full"])
def _tile_stats_kernel(x_ptr, out_ptr, scale_ptr, scale_val, n_full,
                       FP8: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
                       U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                       SUM32: tl.constexpr = False, PARTS: tl.constexpr = 3,
                       BALLOT: tl.constexpr = 0):
    # PARTS (benchmarks only, to see where time goes): 1 = format counts, 2 = histogram
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    TILE: tl.constexpr = U * T * V
    if HAS_SCALE_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_val
    lanes = tl.arange(0, TILE)
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
        # a 1-D load (16-byte vectors, coalesced) seen as [U, T, V]: thread t holds [:, t, :]
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
            mn = tl.minimum(mn, _tmin(tl.where(fin, x, float("inf"))))
            mx = tl.maximum(mx, _tmax(tl.where(fin, x, float("-inf"))))
            amx = tl.maximum(amx, _tmax(tl.where(fin, u, -1)))
            fbits = tl.where(u > _INF, 0x7FC00000, bits)  # canonical NaN, as in the reference
            hmax = tl.max(_tmax(tl.where(fin, u, 0)), 0)
        else:
            valid = nz
            xf = x
            mn = tl.minimum(mn, _tmin(x))
            mx = tl.maximum(mx, _tmax(x))
            amx = tl.maximum(amx, umax_t)
            fbits = bits
            hmax = tmax
        unz_t = _tmin(tl.where(valid, u, _MAXI))
        amn = tl.minimum(amn, unz_t)
        tmin = tl.min(unz_t, 0)
        if SUM32:  # float32 within the tile, float64 across tiles
            s1 += _tsum(xf).to(tl.float64)
            s2 += _tsum(xf * xf).to(tl.float64)
        else:
            x64 = xf.to(tl.float64)
            s1 += _tsum(x64)
            s2 += _tsum(x64 * x64)
        if FP8 == 0:  # the low half is zero for bf16 and fp8 values
            blo += _tsum(fbits & 0xFFFF).to(tl.int64)
        bhi += _tsum((fbits >> 16) & 0xFFFF).to(tl.int64)
        # format thresholds on y = |x * scale| (u itself when the scale is 1)
        if SCALED:
            yu = (tl.abs(x * scale)).to(tl.int32, bitcast=True) & _MAXI
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
    if pid == 0:
        tl.atomic_add(out_ptr + 0, n_full.to(tl.float64))
    tl.atomic_add(out_ptr + 1, c_nan.to(tl.float64))
    tl.atomic_add(out_ptr + 2, c_pinf.to(tl.float64))
    tl.atomic_add(out_ptr + 3, c_ninf.to(tl.float64))
    mine = tl.cdiv(tl.maximum(n_full - pid * TILE, 0), nprog * TILE) * TILE  # lanes I read
    nza = tl.sum(nzall, 0)
    tl.atomic_add(out_ptr + 4, (mine - nza).to(tl.float64))
    tl.atomic_min(out_ptr + 5, tl.min(mn, 0).to(tl.float64))
    tl.atomic_max(out_ptr + 6, tl.max(mx, 0).to(tl.float64))
    am = tl.max(amx, 0)
    amax = tl.where(am < 0, float("-inf"), am.to(tl.float32, bitcast=True))
    tl.atomic_max(out_ptr + 7, amax.to(tl.float64))
    an = tl.min(amn, 0)
    amin = tl.where(an == _MAXI, float("inf"), an.to(tl.float32, bitcast=True))
    tl.atomic_min(out_ptr + 8, amin.to(tl.float64))
    tl.atomic_add(out_ptr + 9, tl.sum(s1, 0))
    tl.atomic_add(out_ptr + 10, tl.sum(s2, 0))
    # overflow = #(y > max) among finite x; underflow = nonzero finite x minus #(y > half-sub);
    # subnormal = #(y > half-sub) - #(y >= subnormal limit). NaN/Inf x have y above every
    # threshold, so they are taken out of each count.
    nzf = nza - nonfin
    g_h4 = tl.sum(ch4, 0) - nonfin
    g_h5 = tl.sum(ch5, 0) - nonfin
    g_h6 = tl.sum(ch6, 0) - nonfin
    tl.atomic_add(out_ptr + O_E4 + 0, (tl.sum(cm4, 0) - nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_E4 + 1, (nzf - g_h4).to(tl.float64))
    tl.atomic_add(out_ptr + O_E4 + 2, (g_h4 - tl.sum(cs4, 0) + nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 0, (tl.sum(cm5, 0) - nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 1, (nzf - g_h5).to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 2, (g_h5 - tl.sum(cs5, 0) + nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 0, (tl.sum(cm6, 0) - nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 1, (nzf - g_h6).to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 2, (g_h6 - tl.sum(cs6, 0) + nonfin).to(tl.float64))
    tl.atomic_add(out_ptr + O_HIST - 2, tl.sum(blo, 0).to(tl.float64))
    tl.atomic_add(out_ptr + O_HIST - 1, tl.sum(bhi, 0).to(tl.float64))
    # empty bins are skipped: most of a row's atomics otherwise, and they serialize on the row
    tl.atomic_add(out_ptr + O_HIST + bins, hist.to(tl.float64), mask=hist != 0)
    if BALLOT:
        lane = tl.arange(0, T) % 32
        tl.atomic_add(out_ptr + O_HIST + (e0 - 31) + lane, hc0.to(tl.float64), mask=hc0 != 0)
        tl.atomic_add(out_ptr + O_HIST + (e0 - 31) + 32 + lane, hc1.to(tl.float64),
                      mask=hc1 != 0)


def tile_shape(itemsize: int, interpreting: bool, num_warps: int = 4,
               u: "int | None" = None) -> tuple[int, int, int]:
    """(U, T, V): V elements per 16-byte load, T threads, U 16-byte loads per thread and tile."""
    v = 16 // itemsize
    if interpreting:  # few, wide programs; 8192-element tiles like the interpreter's blocks
        return 8192 // (256 * v), 256, v
    # one 16-byte load per thread and tile (two for float32): measured fastest on the H200
    # (benchmarks/RESULTS.md, "Statistics kernel speed"); more loads per tile cost registers
    rows = u if isinstance(u, int) else max(1, 8 // v)
    return rows, 32 * num_warps, v


def launch_tile(x, n_full: int, out_row, scale_ptr, scale_val: float, has_ptr: bool,
                scaled: bool, fp8: int, shape: tuple, progs: int, num_warps: int = 4,
                sum32: bool = False, parts: int = 3, ballot: bool = False,
                direct: bool = False) -> None:
    """x: the (bit-view) flat tensor; reads x[:n_full], n_full a multiple of the tile size."""
    u, t, v = shape
    consts = dict(FP8=fp8, SCALED=scaled, HAS_SCALE_PTR=has_ptr, U=u, T=t, V=v, SUM32=sum32,
                  PARTS=parts, BALLOT=int(ballot))
    if direct:  # compiled (not the interpreter): launch.FastLaunch
        _launch(progs, (x, out_row, scale_ptr, scale_val, n_full), consts, num_warps)
    else:
        _tile_stats_kernel[(progs,)](x, out_row, scale_ptr, scale_val, n_full, **consts,
                                     num_warps=num_warps)


_launch = FastLaunch(_tile_stats_kernel)
