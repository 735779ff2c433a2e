"""The small pieces every kernel pass shares: decoding fp8 bytes, the scale rule
(stats/scale.py), the shift (stats/layout.py: load, claim with one compare-and-swap, re-express a
program's sums at the row's shift) and the scalar fields' atomics."""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import FLT_MIN_VALUE, UNSET_SHIFT_BITS, Enc, Row


@triton.jit
def _sane_scale(s):
    # a tensor-valued scale, loaded as float32, by stats/scale.py's rule: |s|, NaN as +inf,
    # below float32's smallest normal as 0
    s = tl.abs(s)
    s = tl.where(s != s, float("inf"), s)
    return tl.where(s < FLT_MIN_VALUE, 0.0, s)


@triton.jit
def _decode_fp8(b, IS_E5M2: tl.constexpr):
    # b: int32 in [0, 255] holding the raw fp8 bits. The sign goes in as a bit (a float negation
    # may compile to 0 - v, which turns -0.0 into +0.0).
    sign = (b >> 7) << 31
    if IS_E5M2:
        e = (b >> 2) & 31
        m = b & 3
        normal = (((e - 15 + 127) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 1.52587890625e-05  # 2**-16
        v = tl.where(e == 0, sub, normal)
        v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
    else:
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e - 7 + 127) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # 2**-9
        v = tl.where(e == 0, sub, normal)
        v = tl.where((e == 15) & (m == 7), float("nan"), v)
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _put(v, idx, i: tl.constexpr, x):
    return tl.where(idx == i, x.to(tl.float64), v)


@triton.jit
def _load_shift(k_ptr, ENC: tl.constexpr):
    # this tensor's shift, as every program of every launch over it loads it: its first
    # element (k_ptr), 0 when that is not finite, never -0.0 (the unset mark); float64
    if ENC == Enc.E4M3:
        kx = _decode_fp8(tl.load(k_ptr).to(tl.int32), False)
    elif ENC == Enc.E5M2:
        kx = _decode_fp8(tl.load(k_ptr).to(tl.int32), True)
    elif ENC == Enc.BF16:
        kx = (tl.load(k_ptr).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        kx = tl.load(k_ptr).to(tl.float32)
    ok = (kx == kx) & (tl.abs(kx) != float("inf")) & (kx != 0)
    return tl.where(ok, kx, 0.0).to(tl.float64)


@triton.jit
def _claim_shift(out_ptr, kp):
    # The row's shift: the row's when it has one, else kp, which this program (or another of
    # this launch: every program of a launch over a row proposes the same kp, since a launch
    # never holds two tensors of one row) claims with a compare-and-swap. The CAS is a
    # one-element tensor op with its result unused: relaxed, no shared memory, no barrier, no
    # wait (a scalar CAS whose result is used waits for the round trip, then a barrier). The
    # row's value is a plain load (L2: stale L1 lines cannot hold a value from before this
    # launch), issued now and used by the epilogue only (_at_row_shift).
    bits = out_ptr.to(tl.pointer_type(tl.int64)) + Row.SHIFT
    rb = tl.load(bits, cache_modifier=".cg")
    one = tl.arange(0, 1)
    tl.atomic_cas(bits + one, tl.full([1], UNSET_SHIFT_BITS, tl.int64),
                  tl.zeros([1], tl.int64) + kp.to(tl.int64, bitcast=True), sem="relaxed")
    return tl.where(rb == UNSET_SHIFT_BITS, kp, rb.to(tl.float64, bitcast=True))


@triton.jit
def _at_row_shift(v, idx, s1, s2k, nf, kp, krow):
    # the program's shifted sums at the row's shift krow, into v: s1 the sum of its nf finite
    # values, s2k the sum of their (x - kp)^2 (stats/layout.py's merge formula)
    nf = nf.to(tl.float64)
    d = kp - krow
    sk = s1 - nf * kp
    v = _put(v, idx, Row.SHIFT_SUM, s1 - nf * krow)
    return _put(v, idx, Row.SHIFT_SUMSQ, s2k + 2.0 * d * sk + nf * d * d)


@triton.jit
def _emit_scalars(out_ptr, idx, v):
    # The row's scalar fields (v[i] for field i < Row.HIST) in three vector atomics, relaxed and
    # with no use of the returned value. One scalar atomic per field instead compiles to
    # barrier, thread-0 acq_rel atomic, barrier: about 25 round trips at the end of every
    # program, most of a small tensor's GPU time (the PTX shows it).
    is_min = (idx == Row.MIN) | (idx == Row.ABSMIN_NZ)
    is_max = (idx == Row.MAX) | (idx == Row.ABSMAX)
    is_sum = (idx < Row.HIST) & (is_min == 0) & (is_max == 0) & (idx != Row.SHIFT)
    tl.atomic_add(out_ptr + idx, v, mask=is_sum & (v != 0), sem="relaxed")
    tl.atomic_min(out_ptr + idx, v, mask=is_min & (v != float("inf")), sem="relaxed")
    tl.atomic_max(out_ptr + idx, v, mask=is_max & (v != float("-inf")), sem="relaxed")

