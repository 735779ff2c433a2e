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

import triton
import triton.language as tl

from .ptx import _l2_prefetch, _lane_hist_count_byte, _lane_hist_init, _lane_hist_read
from .stats_triton import _decode_fp8, _put
from .tile_ops import (HBINS, O_E4, O_E5, O_F16, O_HIST, TH4, TH5, TH6, TM4, TM5, TM6, TS4,
                       TS5, TS6, _INF, _MAXI, _NEGINF)


@triton.jit
def _count(h, sel):
    return tl.sum(tl.where(sel, h, 0).to(tl.int64), 0)


@triton.jit
def _count_bytes(cur, h, table, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                 LANE: tl.constexpr):
    if LANE:
        _lane_hist_count_byte(tl.reshape(cur, [U, T, V]).to(tl.int32), table)
    else:
        h += tl.histogram(cur.to(tl.int32), 256)
    return h


@triton.jit
def _fp8_tiles(x_ptr, out_ptr, scale, n_full, pid, nprog, lanes, FP8: tl.constexpr,
               U: tl.constexpr, T: tl.constexpr, V: tl.constexpr, LANE: tl.constexpr,
               PREF: tl.constexpr = 0):
    # Adds the row's histogram into out_ptr and returns the row's scalar fields as a 32-vector.
    # LANE: the shared-memory lane histogram (GPU) instead of tl.histogram. PREF (GPU): L2
    # prefetch, tiles ahead.
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
    x = _decode_fp8(b, FP8 == 2)  # the value of each byte
    bits = x.to(tl.int32, bitcast=True)
    u = bits & _MAXI
    fin = u < _INF
    nz = fin & (u != 0)
    present = h > 0
    hf = h.to(tl.float64)
    x64 = tl.where(fin, x, 0.0).to(tl.float64)
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, 0, tl.where(pid == 0, n_full, 0))
    v = _put(v, idx, 1, _count(h, u > _INF))
    v = _put(v, idx, 2, _count(h, bits == _INF))
    v = _put(v, idx, 3, _count(h, bits == _NEGINF))
    v = _put(v, idx, 4, _count(h, fin & (u == 0)))
    v = _put(v, idx, 5, tl.min(tl.where(present & fin, x, float("inf")), 0))
    v = _put(v, idx, 6, tl.max(tl.where(present & fin, x, float("-inf")), 0))
    v = _put(v, idx, 7, tl.max(tl.where(present & fin, tl.abs(x), float("-inf")), 0))
    v = _put(v, idx, 8, tl.min(tl.where(present & nz, tl.abs(x), float("inf")), 0))
    v = _put(v, idx, 9, tl.sum(hf * x64, 0))
    v = _put(v, idx, 10, tl.sum(hf * x64 * x64, 0))
    # y = |x * scale| in float32, as the reference computes it
    yu = tl.abs(x * scale).to(tl.int32, bitcast=True) & _MAXI
    v = _put(v, idx, O_E4 + 0, _count(h, fin & (yu > TM4)))
    v = _put(v, idx, O_E4 + 1, _count(h, nz & (yu <= TH4)))
    v = _put(v, idx, O_E4 + 2, _count(h, fin & (yu > TH4) & (yu <= TS4)))
    v = _put(v, idx, O_E5 + 0, _count(h, fin & (yu > TM5)))
    v = _put(v, idx, O_E5 + 1, _count(h, nz & (yu <= TH5)))
    v = _put(v, idx, O_E5 + 2, _count(h, fin & (yu > TH5) & (yu <= TS5)))
    v = _put(v, idx, O_F16 + 0, _count(h, fin & (yu > TM6)))
    v = _put(v, idx, O_F16 + 1, _count(h, nz & (yu <= TH6)))
    v = _put(v, idx, O_F16 + 2, _count(h, fin & (yu > TH6) & (yu <= TS6)))
    fbits = tl.where(u > _INF, 0x7FC00000, bits)  # canonical NaN, as in the reference
    h64 = h.to(tl.int64)
    v = _put(v, idx, O_HIST - 2, tl.sum(h64 * (fbits & 0xFFFF), 0))
    v = _put(v, idx, O_HIST - 1, tl.sum(h64 * ((fbits >> 16) & 0xFFFF), 0))
    # each byte's count straight into the row bin of its |value| (exponent field - 31, clamped
    # to 0..127); bytes sharing a bin are merged by the atomics
    k = tl.minimum(tl.maximum((u >> 23) - 31, 0), HBINS - 1)
    tl.atomic_add(out_ptr + O_HIST + k, hf, mask=nz & present, sem="relaxed")
    return v
