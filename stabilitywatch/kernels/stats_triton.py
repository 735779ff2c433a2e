"""Fused one-pass statistics kernel (Triton): jit kernel, launcher, public function.

Each program walks the tensor with a grid stride, keeps per-lane accumulators in registers
(float64 sums, int32 counts, float32 extrema, an int32 exponent histogram) and merges its partial
row into a float64 row with atomics at the end. Because the merge is atomic the same row can
take several tensors (micro-batches, repeated calls) and no host work or sync is needed.
fp8 inputs are read as bytes and bf16 inputs as 16-bit words, and decoded with integer
arithmetic (a bf16 word is the top half of a float32): the interpreter's own fp8 decoding is
wrong, and so is its bf16 -> fp32 cast of bf16 subnormals (triton 3.9 interpreter
_convert_float renormalises them); this way both paths run the same exact code.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..stats.layout import N_STATS, ROW_DTYPE, init_row_tensor
from ..stats.scale import effective_scale
from .constants import (BITS_VIEW, CANONICAL_NAN, E4M3_MAX, E4M3_SUBNORMAL_LIMIT, E4M3_UNDERFLOW,
                        E5M2_MAX, E5M2_SUBNORMAL_LIMIT, E5M2_UNDERFLOW, ENCODING, FP16_MAX,
                        FP16_SUBNORMAL_LIMIT, FP16_UNDERFLOW, HBINS, HEMIN, Enc, Row)
from .launch import FastLaunch
from .row_ops import (_at_row_shift, _claim_shift, _decode_fp8, _emit_scalars, _load_shift, _put,
                      _sane_scale)
from .stats_tile import _launch as _tile_launch
from .stats_tile import _tile_stats_kernel
from .tuning import (DEFAULT, INTERPRET, Tuning, general_shape, interpreting, prefetch_tiles,
                     sm_count, tile_plan, tile_programs, tile_shape)


@triton.jit
def _fmt_counts(y, fin, nz, MAX: tl.constexpr, HALF_SUB: tl.constexpr, SUB_LIMIT: tl.constexpr):
    over = (fin & (y > MAX)).to(tl.int32)
    under = (nz & (y <= HALF_SUB)).to(tl.int32)
    sub = (fin & (y > HALF_SUB) & (y < SUB_LIMIT)).to(tl.int32)
    return over, under, sub


# compiled: the fields of _general_row in one block-wide reduction (tl.reduce over a tuple)
_ONE_REDUCE = tl.constexpr(not INTERPRET)


@triton.jit
def _fold_general(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                  a18, a19, a20, a21, a22, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12,
                  b13, b14, b15, b16, b17, b18, b19, b20, b21, b22):
    # _general_row's fields: 18 sums, then min, max, max, min, then one more sum
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8,
            a9 + b9, a10 + b10, a11 + b11, a12 + b12, a13 + b13, a14 + b14, a15 + b15, a16 + b16,
            a17 + b17, tl.minimum(a18, b18), tl.maximum(a19, b19), tl.maximum(a20, b20),
            tl.minimum(a21, b21), a22 + b22)


# k_ptr: the tensor's first element (the shift; x_ptr itself unless x is a tensor's tail). n is
# never specialised: an int argument equal to 1 would become a compile-time Python int on the GPU,
# and `n.to(...)` would not compile for one-element tensors.
@triton.jit(do_not_specialize=["n"])
def _row_stats_kernel(x_ptr, k_ptr, out_ptr, scale_ptr, scale_val, n,
                      ENC: tl.constexpr, HAS_SCALE_PTR: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_SCALE_PTR:
        scale = _sane_scale(tl.load(scale_ptr).to(tl.float32))
    else:
        scale = scale_val
    _general_row(x_ptr, k_ptr, out_ptr, scale, n, tl.program_id(0), tl.num_programs(0), ENC,
                 BLOCK)


@triton.jit
def _general_row(x_ptr, k_ptr, out_ptr, scale, n, pid, nprog, ENC: tl.constexpr,
                 BLOCK: tl.constexpr):
    # this program's share (blocks pid, pid + nprog, ...) of n elements at x_ptr, merged into
    # the row at out_ptr; k_ptr: the element that gives the shift
    kp = _load_shift(k_ptr, ENC)
    krow = _claim_shift(out_ptr, kp)
    lanes = tl.arange(0, BLOCK)
    zi = tl.zeros([BLOCK], dtype=tl.int32)
    c_nan = zi
    c_pinf = zi
    c_ninf = zi
    c_zero = zi
    c_nz = zi
    e4o = zi
    e4u = zi
    e4s = zi
    e5o = zi
    e5u = zi
    e5s = zi
    f16o = zi
    f16u = zi
    f16s = zi
    s1 = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    s2k = tl.zeros([BLOCK], dtype=tl.float64)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    amx = tl.full([BLOCK], float("-inf"), tl.float32)
    amn = tl.full([BLOCK], float("inf"), tl.float32)
    hist = tl.zeros([HBINS], dtype=tl.int32)
    blo = zi
    bhi = zi
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + lanes
        m = offs < n
        if ENC == Enc.E4M3:
            x = _decode_fp8(tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32), False)
        elif ENC == Enc.E5M2:
            x = _decode_fp8(tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32), True)
        elif ENC == Enc.BF16:  # bf16 bits (int16, sign-extended): shifting drops the extension
            x = (tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) << 16).to(tl.float32,
                                                                                 bitcast=True)
        else:
            x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
        a = tl.abs(x)
        fbits = tl.where(x != x, CANONICAL_NAN, x.to(tl.int32, bitcast=True))
        blo += tl.where(m, fbits & 0xFFFF, 0)
        bhi += tl.where(m, (fbits >> 16) & 0xFFFF, 0)
        isnan = m & (x != x)
        pinf = m & (x == float("inf"))
        ninf = m & (x == float("-inf"))
        fin = m & (x == x) & (a != float("inf"))
        zero = fin & (a == 0)
        nz = fin & (a != 0)
        c_nan += isnan.to(tl.int32)
        c_pinf += pinf.to(tl.int32)
        c_ninf += ninf.to(tl.int32)
        c_zero += zero.to(tl.int32)
        c_nz += nz.to(tl.int32)
        xf = tl.where(fin, x, 0.0)
        x64 = xf.to(tl.float64)
        s1 += x64
        s2 += x64 * x64
        dk = tl.where(fin, x64 - kp, 0.0)
        s2k += dk * dk
        mn = tl.minimum(mn, tl.where(fin, x, float("inf")))
        mx = tl.maximum(mx, tl.where(fin, x, float("-inf")))
        amx = tl.maximum(amx, tl.where(fin, a, float("-inf")))
        amn = tl.minimum(amn, tl.where(nz, a, float("inf")))
        y = tl.abs(x * scale)
        o, u, s = _fmt_counts(y, fin, nz, E4M3_MAX, E4M3_UNDERFLOW, E4M3_SUBNORMAL_LIMIT)
        e4o += o
        e4u += u
        e4s += s
        o, u, s = _fmt_counts(y, fin, nz, E5M2_MAX, E5M2_UNDERFLOW, E5M2_SUBNORMAL_LIMIT)
        e5o += o
        e5u += u
        e5s += s
        o, u, s = _fmt_counts(y, fin, nz, FP16_MAX, FP16_UNDERFLOW, FP16_SUBNORMAL_LIMIT)
        f16o += o
        f16u += u
        f16s += s
        # floor(log2|x|) from the float32 exponent field; float32 subnormals land in bin 0.
        ex = ((tl.where(nz, a, 1.0).to(tl.int32, bitcast=True) >> 23) & 255) - 127
        b = tl.minimum(tl.maximum(ex - HEMIN, 0), HBINS - 1)
        # lanes that are not nonzero-finite go to bin 0 and are taken back out below
        hist += tl.histogram(tl.where(nz, b, 0), HBINS)

    # one block-wide reduction for all 23 fields (each reduction is a barrier and a
    # shared-memory round trip, in a chain the program ends on)
    if _ONE_REDUCE:
        r = tl.reduce((c_nan, c_pinf, c_ninf, c_zero, e4o, e4u, e4s, e5o, e5u, e5s, f16o, f16u,
                       f16s, c_nz, blo.to(tl.int64), bhi.to(tl.int64), s1, s2, mn, mx, amx, amn,
                       s2k), 0, _fold_general)
    else:  # the interpreter runs a combine function element by element, in Python
        r = (tl.sum(c_nan, 0), tl.sum(c_pinf, 0), tl.sum(c_ninf, 0), tl.sum(c_zero, 0),
             tl.sum(e4o, 0), tl.sum(e4u, 0), tl.sum(e4s, 0), tl.sum(e5o, 0), tl.sum(e5u, 0),
             tl.sum(e5s, 0), tl.sum(f16o, 0), tl.sum(f16u, 0), tl.sum(f16s, 0), tl.sum(c_nz, 0),
             tl.sum(blo.to(tl.int64), 0), tl.sum(bhi.to(tl.int64), 0), tl.sum(s1, 0),
             tl.sum(s2, 0), tl.min(mn, 0), tl.max(mx, 0), tl.max(amx, 0), tl.min(amn, 0),
             tl.sum(s2k, 0))
    (t_nan, t_pinf, t_ninf, t_zero, t_e4o, t_e4u, t_e4s, t_e5o, t_e5u, t_e5s, t_f16o, t_f16u,
     t_f16s, t_nz, t_blo, t_bhi, t_s1, t_s2, t_mn, t_mx, t_amx, t_amn, t_s2k) = r
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, Row.NUMEL, tl.where(pid == 0, n, 0))
    v = _put(v, idx, Row.NAN, t_nan)
    v = _put(v, idx, Row.POSINF, t_pinf)
    v = _put(v, idx, Row.NEGINF, t_ninf)
    v = _put(v, idx, Row.ZEROS, t_zero)
    v = _put(v, idx, Row.E4M3_OVERFLOW, t_e4o)
    v = _put(v, idx, Row.E4M3_UNDERFLOW, t_e4u)
    v = _put(v, idx, Row.E4M3_SUBNORMAL, t_e4s)
    v = _put(v, idx, Row.E5M2_OVERFLOW, t_e5o)
    v = _put(v, idx, Row.E5M2_UNDERFLOW, t_e5u)
    v = _put(v, idx, Row.E5M2_SUBNORMAL, t_e5s)
    v = _put(v, idx, Row.FP16_OVERFLOW, t_f16o)
    v = _put(v, idx, Row.FP16_UNDERFLOW, t_f16u)
    v = _put(v, idx, Row.FP16_SUBNORMAL, t_f16s)
    v = _put(v, idx, Row.MIN, t_mn)
    v = _put(v, idx, Row.MAX, t_mx)
    v = _put(v, idx, Row.ABSMAX, t_amx)
    v = _put(v, idx, Row.ABSMIN_NZ, t_amn)
    v = _put(v, idx, Row.SUM, t_s1)
    v = _put(v, idx, Row.SUMSQ, t_s2)
    v = _put(v, idx, Row.BITS_LO, t_blo)
    v = _put(v, idx, Row.BITS_HI, t_bhi)
    v = _at_row_shift(v, idx, t_s1, t_s2k, t_zero + t_nz, kp, krow)
    _emit_scalars(out_ptr, idx, v)
    bins = tl.arange(0, HBINS)
    n_iter = tl.cdiv(n - pid * BLOCK, nprog * BLOCK)
    excess = tl.maximum(n_iter, 0) * BLOCK - t_nz
    hist = hist - tl.where(bins == 0, excess, 0)
    # empty bins are skipped: most of a small tensor's atomics otherwise
    tl.atomic_add(out_ptr + Row.HIST + bins, hist.to(tl.float64), mask=hist != 0, sem="relaxed")


KERNEL_DTYPES = tuple(ENCODING)
_interpreting = interpreting  # the sentinel's launcher asks here


def launch_row_stats(flat: torch.Tensor, out_row: torch.Tensor,
                     scale: "float | torch.Tensor" = 1.0, tuning: "Tuning | None" = None) -> None:
    """Merge the statistics of a flat (1-D, contiguous) tensor into out_row, a float64 row of
    N_STATS values that holds the identity row or earlier results. No host sync.

    Full tiles go to the tile kernel (stats_tile.py), the rest (small tensors, a tail) to the
    general kernel here; both merge into the row with atomics. `tuning` (tuning.Tuning) is for
    tests and benchmarks: every tuning gives the same row."""
    run_row_stats(flat, out_row, scale, tuning, None)


def run_row_stats(flat: torch.Tensor, out_row: torch.Tensor, scale: "float | torch.Tensor",
                  tuning: "Tuning | None", tile_kernel: "tuple | None") -> None:
    """launch_row_stats, with another tile kernel where tile_kernel is (jit function, extra
    constexprs after the kernel's own, its launch.FastLaunch): kernels/_timing.py. `flat` may
    also be any contiguous tensor: the kernels read its n elements from its first."""
    n = flat.numel()
    if n == 0:
        return
    if not flat.is_contiguous():  # the kernels read n consecutive elements from data_ptr
        raise ValueError("launch_row_stats needs a contiguous tensor (use dispatch.flat_view)")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"launch_row_stats: tuning must be a kernels.tuning.Tuning, got "
                        f"{type(tuning).__name__}")
    has_ptr = isinstance(scale, torch.Tensor)
    scale_ptr = scale if has_ptr else out_row  # unused when HAS_SCALE_PTR is False
    # a host scale made sane here (stats/scale.py): a float outside float32's range would also
    # reach the kernel as float64
    scale_val = 1.0 if has_ptr else effective_scale(scale)
    scaled = has_ptr or scale_val != 1.0
    cuda = flat.is_cuda and not INTERPRET
    if tuning is None and tile_kernel is None and cuda:  # a kept plan: no decisions per call
        key = (flat.dtype, n, flat.device.index, has_ptr, scaled, flat.data_ptr() % 4 == 0)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= 4096:  # sizes that keep changing: start over
                _PLANS.clear()
            plan = _PLANS[key] = _RowPlan(flat, n, has_ptr, scaled, cuda, DEFAULT, None)
    else:
        plan = _RowPlan(flat, n, has_ptr, scaled, cuda, tuning or DEFAULT, tile_kernel)
    plan.run(flat, out_row, scale_ptr, scale_val)


_fast_general = FastLaunch(_row_stats_kernel)


class _RowPlan:
    """launch_row_stats' decisions for one kind of tensor (dtype, size, device, kind of scale,
    4-byte alignment) and one tuning. On a GPU with the default tuning it is kept and its
    launches go through launch.Bound (benchmarks/diagnose_record.py: ~6 us of host time less
    per record)."""

    def __init__(self, flat: torch.Tensor, n: int, has_ptr: bool, scaled: bool, cuda: bool,
                 tuning: Tuning, tile_kernel: "tuple | None"):
        enc = self.enc = ENCODING[flat.dtype]
        index = flat.device.index
        direct = cuda and tuning.direct
        self.n_full, self.tile = 0, None
        shape = tile_shape(flat.element_size(), not cuda, tuning.num_warps,
                           tuning.loads_per_thread)
        tile = shape[0] * shape[1] * shape[2]
        if not tuning.general_only and n >= tile:
            self.n_full = n - n % tile
            tiles = self.n_full // tile
            progs = (tile_programs(tiles, tile, sm_count(index), tuning.progs_per_sm,
                                   tuning.tiles_per_prog) if cuda else 4)
            self.tile_progs = min(tiles, progs)
            plan = tile_plan(tuning, enc, shape, self.n_full, self.tile_progs, has_ptr, scaled,
                             flat.data_ptr() % 4 == 0, cuda,
                             cuda and prefetch_tiles(index, 1) == 1)
            consts, opts = plan.constexprs, plan.options
            fn, launch = _tile_stats_kernel, _tile_launch
            if tile_kernel is not None:
                fn, extra, launch = tile_kernel
                consts = {**consts, **extra}
            self.tile = (launch.bind(consts, plan.num_warps, **opts) if direct
                         else _triton_launch(fn, consts, plan.num_warps, opts))
        self.n_tail, self.tail = n - self.n_full, None
        if self.n_tail:
            block, self.tail_progs = general_shape(self.n_tail, flat.device)
            consts = dict(ENC=int(enc), HAS_SCALE_PTR=has_ptr, BLOCK=block)
            self.tail = (_fast_general.bind(consts, 4) if direct
                         else _triton_launch(_row_stats_kernel, consts, 4, {}))

    def run(self, flat: torch.Tensor, out_row: torch.Tensor, scale_ptr, scale_val: float):
        x = flat.view(BITS_VIEW[self.enc]) if self.enc in BITS_VIEW else flat
        if self.tile is not None:
            self.tile(self.tile_progs, (x, out_row, scale_ptr, scale_val, self.n_full))
        if self.tail is not None:
            tail = (x if x.dim() == 1 else x.view(-1))[self.n_full:] if self.n_full else x
            self.tail(self.tail_progs, (tail, x, out_row, scale_ptr, scale_val, self.n_tail))


def _triton_launch(fn, consts: dict, warps: int, opts: dict):
    # Triton's own launcher (the interpreter; Tuning(direct=False)), called as launch.Bound is
    def launch(progs: int, args: tuple) -> None:
        fn[(progs,)](*args, **consts, num_warps=warps, **opts)
    return launch


_PLANS: dict = {}


def triton_row(flat: torch.Tensor, scale: "float | torch.Tensor" = 1.0) -> torch.Tensor:
    """A new statistics row for a flat tensor, computed by the kernel."""
    row = init_row_tensor(flat.device)
    assert row.dtype == ROW_DTYPE and row.numel() == N_STATS
    launch_row_stats(flat, row, scale)
    return row
