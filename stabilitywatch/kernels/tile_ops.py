"""Small helpers shared by the tile kernel's passes (stats_tile.py, tile_fast.py, tile_fp8.py):
reductions over a thread's piece of a tile, decoding a tile, the sums and the fingerprint."""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import Enc
from .row_ops import _decode_fp8


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
def _decode_tile(cur, ENC: tl.constexpr, U: tl.constexpr, T: tl.constexpr, V: tl.constexpr):
    # a 1-D load (16-byte vectors, coalesced) seen as [U, T, V]: thread t holds [:, t, :];
    # returns the values as float32 and their bit patterns
    raw = tl.reshape(cur, [U, T, V])
    if ENC == Enc.E4M3:
        x = _decode_fp8(raw.to(tl.int32), False)
        bits = x.to(tl.int32, bitcast=True)
    elif ENC == Enc.E5M2:
        x = _decode_fp8(raw.to(tl.int32), True)
        bits = x.to(tl.int32, bitcast=True)
    elif ENC == Enc.BF16:  # bf16 bits (int16, sign-extended): the shift drops the extension
        bits = raw.to(tl.int32) << 16
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
    return x, bits


@triton.jit
def _add_sums(x, bits, s1, s2, s2k, kf, blo, bhi, ENC: tl.constexpr, SUM32: tl.constexpr):
    # per-thread float64 sum, sum of squares and sum of (x - kf)^2 of a tile's values (kf: the
    # program's shift, float64, or 0 where x was zeroed), and the fingerprint (sums of the low
    # and high 16 bits of each value's float32 bit pattern). SUM32 (timing only,
    # kernels/_timing.py): float32 sums within the tile
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
    if ENC == Enc.FLOAT:  # the low half is zero for bf16 and fp8 values
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
