"""Lean statistics kernel for the full blocks of a large tensor (the tail goes to the general
kernel in stats_triton.py; both merge into the same row with atomics).

Why it is cheaper per element than the general kernel:
- it works on the float32 bit pattern: for |x| the integer order of the bits is the float order,
  so every format threshold is one integer compare on u = bits & 0x7fffffff;
- NaN/Inf handling runs only in blocks whose largest u is NaN/Inf (a uniform branch);
- a format threshold is compared element by element only in blocks whose range straddles it
  (blocks entirely below it add nothing, blocks entirely above it add their count);
- the exponent histogram uses 32 bins at the block's own exponent offset when the block spans
  fewer than 32 exponents (the usual case), 128 bins otherwise;
- sums: float64 lanes (ACC64, default), or float32 lanes flushed into float64 every 16 blocks.
Counts, min, max and the histogram stay exact.
"""
from __future__ import annotations

import functools
import struct

import triton
import triton.language as tl

from ..formats import FORMATS, Fmt
from ..stats.layout import FMT_BASE, HIST_BINS, HIST_EMIN, Stat
from .stats_triton import _decode_fp8

_INF = tl.constexpr(0x7F800000)
_MAXI = tl.constexpr(0x7FFFFFFF)
_NEGINF = tl.constexpr(-8388608)  # bits of -inf as int32


@triton.jit
def _count_gt(yu, T: tl.constexpr, bmin, bmax, nonzero_in_block, cvec, csc,
              SCALED: tl.constexpr):
    if not SCALED:
        if bmin > T:          # every nonzero lane is above T, zeros never are
            csc += nonzero_in_block
        elif bmax > T:
            cvec += (yu > T).to(tl.int32)
    else:
        if bmax > T:
            cvec += (yu > T).to(tl.int32)
    return cvec, csc


@triton.jit(do_not_specialize=["n_full"])
def _fast_stats_kernel(x_ptr, out_ptr, scale_ptr, scale_val, n_full,
                       FP8: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
                       BLOCK: tl.constexpr, HBINS: tl.constexpr, HEMIN: tl.constexpr,
                       TM4: tl.constexpr, TH4: tl.constexpr, TS4: tl.constexpr,
                       TM5: tl.constexpr, TH5: tl.constexpr, TS5: tl.constexpr,
                       TM6: tl.constexpr, TH6: tl.constexpr, TS6: tl.constexpr,
                       O_E4: tl.constexpr, O_E5: tl.constexpr, O_F16: tl.constexpr,
                       O_HIST: tl.constexpr, ACC64: tl.constexpr = True):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_SCALE_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_val
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, HBINS)
    zi = tl.zeros([BLOCK], dtype=tl.int32)
    c_nan = zi
    c_pinf = zi
    c_ninf = zi
    cm4, cm5, cm6, ch4, ch5, ch6, cs4, cs5, cs6 = zi, zi, zi, zi, zi, zi, zi, zi, zi
    z0 = pid * 0  # an int32 scalar for loop-carried counters
    km4, km5, km6, kh4, kh5, kh6, ks4, ks5, ks6 = z0, z0, z0, z0, z0, z0, z0, z0, z0
    n_zero = z0
    f1 = tl.zeros([BLOCK], dtype=tl.float32)
    f2 = tl.zeros([BLOCK], dtype=tl.float32)
    s1 = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    amx = tl.full([BLOCK], -1, tl.int32)
    amn = tl.full([BLOCK], _MAXI, tl.int32)
    hist = tl.zeros([HBINS], dtype=tl.int32)
    blo = zi
    bhi = zi
    it = z0
    for start in range(pid * BLOCK, n_full, nprog * BLOCK):
        offs = start + lanes
        if FP8 == 1:
            x = _decode_fp8(tl.load(x_ptr + offs).to(tl.int32), False)
            bits = x.to(tl.int32, bitcast=True)
        elif FP8 == 2:
            x = _decode_fp8(tl.load(x_ptr + offs).to(tl.int32), True)
            bits = x.to(tl.int32, bitcast=True)
        elif FP8 == 3:  # bf16 bits: the top half of a float32
            bits = tl.load(x_ptr + offs).to(tl.int32) << 16
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + offs).to(tl.float32)
            bits = x.to(tl.int32, bitcast=True)
        u = bits & _MAXI
        fbits = tl.where(u > _INF, 0x7FC00000, bits)  # canonical NaN, as in the reference
        blo += fbits & 0xFFFF
        bhi += (fbits >> 16) & 0xFFFF
        zero = u == 0
        unz = tl.where(zero, _MAXI, u)
        bmax = tl.max(u, 0)
        bmin = tl.min(unz, 0)
        bz = tl.sum(zero.to(tl.int32), 0)
        n_zero += bz
        if bmax >= _INF:  # rare: NaN or Inf somewhere in this block
            fin = u < _INF
            c_nan += (u > _INF).to(tl.int32)
            c_pinf += (bits == _INF).to(tl.int32)
            c_ninf += (bits == _NEGINF).to(tl.int32)
            xf = tl.where(fin, x, 0.0)
            mn = tl.minimum(mn, tl.where(fin, x, float("inf")))
            mx = tl.maximum(mx, tl.where(fin, x, float("-inf")))
            amx = tl.maximum(amx, tl.where(fin, u, -1))
            unzf = tl.where(fin, unz, _MAXI)
            amn = tl.minimum(amn, unzf)
            bmin = tl.min(unzf, 0)
            bmaxf = tl.max(tl.where(fin, u, 0), 0)
            valid = fin & (u != 0)
        else:
            xf = x
            mn = tl.minimum(mn, x)
            mx = tl.maximum(mx, x)
            amx = tl.maximum(amx, u)
            amn = tl.minimum(amn, unz)
            bmaxf = bmax
            valid = u != 0
        if ACC64:
            x64 = xf.to(tl.float64)
            s1 += x64
            s2 += x64 * x64
        else:
            f1 += xf
            f2 += xf * xf
            it += 1
            if it % 16 == 0:
                s1 += f1.to(tl.float64)
                s2 += f2.to(tl.float64)
                f1 = tl.zeros([BLOCK], dtype=tl.float32)
                f2 = tl.zeros([BLOCK], dtype=tl.float32)
        # format thresholds on y = |x * scale| (u itself when the scale is 1)
        if SCALED:
            yu = (tl.abs(x * scale)).to(tl.int32, bitcast=True) & _MAXI
            ymin = tl.min(yu, 0)
            ymax = tl.max(yu, 0)
        else:
            yu = u
            ymin = bmin
            ymax = bmax
        nzb = BLOCK - bz
        cm4, km4 = _count_gt(yu, TM4, ymin, ymax, nzb, cm4, km4, SCALED)
        cm5, km5 = _count_gt(yu, TM5, ymin, ymax, nzb, cm5, km5, SCALED)
        cm6, km6 = _count_gt(yu, TM6, ymin, ymax, nzb, cm6, km6, SCALED)
        ch4, kh4 = _count_gt(yu, TH4, ymin, ymax, nzb, ch4, kh4, SCALED)
        ch5, kh5 = _count_gt(yu, TH5, ymin, ymax, nzb, ch5, kh5, SCALED)
        ch6, kh6 = _count_gt(yu, TH6, ymin, ymax, nzb, ch6, kh6, SCALED)
        cs4, ks4 = _count_gt(yu, TS4, ymin, ymax, nzb, cs4, ks4, SCALED)
        cs5, ks5 = _count_gt(yu, TS5, ymin, ymax, nzb, cs5, ks5, SCALED)
        cs6, ks6 = _count_gt(yu, TS6, ymin, ymax, nzb, cs6, ks6, SCALED)
        # exponent histogram of finite nonzero |x|
        b = tl.minimum(tl.maximum((u >> 23) - (127 + HEMIN), 0), HBINS - 1)
        lo = tl.minimum(tl.maximum((bmin >> 23) - (127 + HEMIN), 0), HBINS - 1)
        hi = tl.minimum(tl.maximum((bmaxf >> 23) - (127 + HEMIN), 0), HBINS - 1)
        if hi - lo < 32:
            h32 = tl.histogram(tl.where(valid, b - lo, 0), 32, mask=valid)
            rel = bins - lo
            inwin = (rel >= 0) & (rel < 32)
            hist += tl.where(inwin, tl.gather(h32, tl.where(inwin, rel, 0), 0), 0)
        else:
            hist += tl.histogram(tl.where(valid, b, 0), HBINS, mask=valid)
    s1 += f1.to(tl.float64)
    s2 += f2.to(tl.float64)

    nan = tl.sum(c_nan, 0)
    pinf = tl.sum(c_pinf, 0)
    ninf = tl.sum(c_ninf, 0)
    nonfin = nan + pinf + ninf
    mine = tl.cdiv(tl.maximum(n_full - pid * BLOCK, 0), nprog * BLOCK) * BLOCK  # lanes I read
    if pid == 0:
        tl.atomic_add(out_ptr + 0, n_full.to(tl.float64))
    tl.atomic_add(out_ptr + 1, nan.to(tl.float64))
    tl.atomic_add(out_ptr + 2, pinf.to(tl.float64))
    tl.atomic_add(out_ptr + 3, ninf.to(tl.float64))
    tl.atomic_add(out_ptr + 4, n_zero.to(tl.float64))
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
    # overflow = #(y > max) among finite x; underflow = nonzero finite x minus #(y > half-sub)
    # among finite x; subnormal = #(y > half-sub) - #(y >= subnormal limit); NaN/Inf x always
    # have y above every threshold, so they are taken out of each count
    nzf = mine - n_zero - nonfin
    g_m4 = tl.sum(cm4, 0) + km4 - nonfin
    g_m5 = tl.sum(cm5, 0) + km5 - nonfin
    g_m6 = tl.sum(cm6, 0) + km6 - nonfin
    g_h4 = tl.sum(ch4, 0) + kh4 - nonfin
    g_h5 = tl.sum(ch5, 0) + kh5 - nonfin
    g_h6 = tl.sum(ch6, 0) + kh6 - nonfin
    g_s4 = tl.sum(cs4, 0) + ks4 - nonfin
    g_s5 = tl.sum(cs5, 0) + ks5 - nonfin
    g_s6 = tl.sum(cs6, 0) + ks6 - nonfin
    tl.atomic_add(out_ptr + O_E4 + 0, g_m4.to(tl.float64))
    tl.atomic_add(out_ptr + O_E4 + 1, (nzf - g_h4).to(tl.float64))
    tl.atomic_add(out_ptr + O_E4 + 2, (g_h4 - g_s4).to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 0, g_m5.to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 1, (nzf - g_h5).to(tl.float64))
    tl.atomic_add(out_ptr + O_E5 + 2, (g_h5 - g_s5).to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 0, g_m6.to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 1, (nzf - g_h6).to(tl.float64))
    tl.atomic_add(out_ptr + O_F16 + 2, (g_h6 - g_s6).to(tl.float64))
    tl.atomic_add(out_ptr + O_HIST - 2, tl.sum(blo.to(tl.int64), 0).to(tl.float64))
    tl.atomic_add(out_ptr + O_HIST - 1, tl.sum(bhi.to(tl.int64), 0).to(tl.float64))
    tl.atomic_add(out_ptr + O_HIST + bins, hist.to(tl.float64))


def _bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


@functools.lru_cache(maxsize=1)
def fast_constants() -> dict:
    out = {}
    for tag, fmt in (("4", Fmt.E4M3), ("5", Fmt.E5M2), ("6", Fmt.FP16)):
        f = FORMATS[fmt]
        out[f"TM{tag}"] = _bits(f.max)                        # y > max
        out[f"TH{tag}"] = _bits(f.underflow_threshold)        # y > half the min subnormal
        out[f"TS{tag}"] = _bits(f.subnormal_limit) - 1        # y >= subnormal limit
    out.update(O_E4=FMT_BASE[Fmt.E4M3], O_E5=FMT_BASE[Fmt.E5M2], O_F16=FMT_BASE[Fmt.FP16],
               O_HIST=int(Stat.HIST), HBINS=HIST_BINS, HEMIN=HIST_EMIN)
    return out


def launch_fast(x, n_full: int, out_row, scale_ptr, scale_val: float, has_ptr: bool,
                scaled: bool, fp8: int, block: int, progs: int, num_warps: int = 4,
                acc64: bool = True) -> None:
    """x: the (bit-view) flat tensor; reads x[:n_full], n_full a multiple of block."""
    _fast_stats_kernel[(progs,)](x, out_row, scale_ptr, scale_val, n_full, FP8=fp8,
                                 SCALED=scaled, HAS_SCALE_PTR=has_ptr, BLOCK=block,
                                 num_warps=num_warps, ACC64=acc64, **fast_constants())
