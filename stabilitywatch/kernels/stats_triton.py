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

import functools
import os

import torch
import triton
import triton.language as tl

from ..formats import FORMATS, Fmt
from ..stats.layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, ROW_DTYPE, Stat, init_row_tensor
from ..stats.scale import effective_scale
from .launch import FastLaunch
from .row_ops import (S_AMAX, S_AMIN, S_BHI, S_BLO, S_MAX, S_MIN, S_SUM, S_SUMSQ,
                      _at_row_shift, _claim_shift, _decode_fp8, _emit_scalars, _load_shift, _put,
                      _sane_scale)

_E4M3, _E5M2, _F16 = FORMATS[Fmt.E4M3], FORMATS[Fmt.E5M2], FORMATS[Fmt.FP16]
# compile-time globals rather than launch arguments (each argument costs launcher time)
E4_MAX, E4_HS, E4_SL = (tl.constexpr(_E4M3.max), tl.constexpr(_E4M3.underflow_threshold),
                        tl.constexpr(_E4M3.subnormal_limit))
E5_MAX, E5_HS, E5_SL = (tl.constexpr(_E5M2.max), tl.constexpr(_E5M2.underflow_threshold),
                        tl.constexpr(_E5M2.subnormal_limit))
F16_MAX, F16_HS, F16_SL = (tl.constexpr(_F16.max), tl.constexpr(_F16.underflow_threshold),
                           tl.constexpr(_F16.subnormal_limit))
O_E4, O_E5, O_F16 = (tl.constexpr(FMT_BASE[Fmt.E4M3]), tl.constexpr(FMT_BASE[Fmt.E5M2]),
                     tl.constexpr(FMT_BASE[Fmt.FP16]))
O_HIST = tl.constexpr(int(Stat.HIST))
HBINS = tl.constexpr(HIST_BINS)
HEMIN = tl.constexpr(HIST_EMIN)


@triton.jit
def _fmt_counts(y, fin, nz, MAX: tl.constexpr, HALF_SUB: tl.constexpr, SUB_LIMIT: tl.constexpr):
    over = (fin & (y > MAX)).to(tl.int32)
    under = (nz & (y <= HALF_SUB)).to(tl.int32)
    sub = (fin & (y > HALF_SUB) & (y < SUB_LIMIT)).to(tl.int32)
    return over, under, sub


# read once: the interpreter is on or off from the moment the @triton.jit functions are made
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# compiled: the fields of _general_row in one block-wide reduction (tl.reduce over a tuple)
_ONE_REDUCE = tl.constexpr(not _INTERPRET)


@triton.jit
def _fold_general(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                  a18, a19, a20, a21, a22, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12,
                  b13, b14, b15, b16, b17, b18, b19, b20, b21, b22):
    # _general_row's fields: 18 sums, then min, max, max, min, then one more sum
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8,
            a9 + b9, a10 + b10, a11 + b11, a12 + b12, a13 + b13, a14 + b14, a15 + b15, a16 + b16,
            a17 + b17, tl.minimum(a18, b18), tl.maximum(a19, b19), tl.maximum(a20, b20),
            tl.minimum(a21, b21), a22 + b22)


# k_ptr: the tensor's first element (the shift; x_ptr itself unless x is a tensor's tail)
@triton.jit(do_not_specialize=["n"])
def _row_stats_kernel(x_ptr, k_ptr, out_ptr, scale_ptr, scale_val, n,
                      FP8: tl.constexpr, HAS_SCALE_PTR: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_SCALE_PTR:
        scale = _sane_scale(tl.load(scale_ptr).to(tl.float32))
    else:
        scale = scale_val
    _general_row(x_ptr, k_ptr, out_ptr, scale, n, tl.program_id(0), tl.num_programs(0), FP8,
                 BLOCK)


@triton.jit
def _general_row(x_ptr, k_ptr, out_ptr, scale, n, pid, nprog, FP8: tl.constexpr,
                 BLOCK: tl.constexpr):
    # this program's share (blocks pid, pid + nprog, ...) of n elements at x_ptr, merged into
    # the row at out_ptr; k_ptr: the element that gives the shift
    kp = _load_shift(k_ptr, FP8)
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
        if FP8 == 1:
            x = _decode_fp8(tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32), False)
        elif FP8 == 2:
            x = _decode_fp8(tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32), True)
        elif FP8 == 3:  # bf16 bits (int16, sign-extended): shifting drops the extension
            x = (tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) << 16).to(tl.float32,
                                                                                 bitcast=True)
        else:
            x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
        a = tl.abs(x)
        fbits = tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))
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
        o, u, s = _fmt_counts(y, fin, nz, E4_MAX, E4_HS, E4_SL)
        e4o += o
        e4u += u
        e4s += s
        o, u, s = _fmt_counts(y, fin, nz, E5_MAX, E5_HS, E5_SL)
        e5o += o
        e5u += u
        e5s += s
        o, u, s = _fmt_counts(y, fin, nz, F16_MAX, F16_HS, F16_SL)
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
    idx = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.float64)
    v = _put(v, idx, 0, tl.where(pid == 0, n, 0))
    for i in tl.static_range(4):  # NaN, +Inf, -Inf, zeros: fields 1..4
        v = _put(v, idx, 1 + i, r[i])
    for i in tl.static_range(9):  # the format counts
        v = _put(v, idx, O_E4 + i, r[4 + i])
    v = _put(v, idx, S_MIN, r[18])
    v = _put(v, idx, S_MAX, r[19])
    v = _put(v, idx, S_AMAX, r[20])
    v = _put(v, idx, S_AMIN, r[21])
    v = _put(v, idx, S_SUM, r[16])
    v = _put(v, idx, S_SUMSQ, r[17])
    v = _put(v, idx, S_BLO, r[14])
    v = _put(v, idx, S_BHI, r[15])
    v = _at_row_shift(v, idx, r[16], r[22], r[3] + r[13], kp, krow)
    _emit_scalars(out_ptr, idx, v)
    bins = tl.arange(0, HBINS)
    n_iter = tl.cdiv(n - pid * BLOCK, nprog * BLOCK)
    excess = tl.maximum(n_iter, 0) * BLOCK - r[13]
    hist = hist - tl.where(bins == 0, excess, 0)
    # empty bins are skipped: most of a small tensor's atomics otherwise
    tl.atomic_add(out_ptr + O_HIST + bins, hist.to(tl.float64), mask=hist != 0, sem="relaxed")


# dtypes read as raw bits (FP8 code: 1 e4m3, 2 e5m2, 3 bf16) and the integer view used to read them
_FP8_CODE = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.bfloat16: 3}
_BITS_VIEW = {1: torch.uint8, 2: torch.uint8, 3: torch.int16}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                 torch.float8_e5m2)


def _interpreting() -> bool:
    return _INTERPRET


@functools.lru_cache(maxsize=None)
def prefetch_tiles(index: "int | None", ahead: int) -> int:
    """`ahead` on devices whose PTX has the L2 bulk prefetch (ptx._l2_prefetch: sm_90 and
    later), else 0: the kernels must still compile on an A100 or an L4."""
    return ahead if torch.cuda.get_device_capability(index) >= (9, 0) else 0


@functools.lru_cache(maxsize=None)
def _sm_count(index: "int | None") -> int:
    # get_device_properties costs ~30 us per call, paid per launch before this cache
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch_shape(n: int, device: torch.device) -> tuple[int, int]:
    if _interpreting() or device.type != "cuda":
        # The interpreter pays per program and per loop step: few, wide programs.
        block, max_progs = 8192, 4
    else:
        block = 1024
        max_progs = _sm_count(device.index) * 8
    return block, max(1, min(-(-n // block), max_progs))


def tile_programs(tiles: int, tile: int, sms: int, per_sm: int = 4, per_prog: int = 8) -> int:
    """Programs for `tiles` tiles of `tile` elements. The fast passes end each program with a
    fixed epilogue (histogram readout, a few block-wide reductions, the row's atomics): several
    tiles per program, at least one program per SM. Their histogram packs 16-bit counts in words
    that lane L of every warp shares: at most 65535 values per word and program, tile // 32 of
    them per tile (past ~2^31 elements, more programs)."""
    progs = min(sms * per_sm, max(sms, tiles // per_prog))
    per_tile = tile // 32
    return max(progs, -(-tiles * per_tile // (65535 - per_tile)))


def launch_row_stats(flat: torch.Tensor, out_row: torch.Tensor,
                     scale: "float | torch.Tensor" = 1.0, tune: "dict | None" = None) -> None:
    """Merge the statistics of a flat (1-D, contiguous) tensor into out_row, a float64 row of
    N_STATS values that holds the identity row or earlier results. No host sync.

    Full tiles go to the tile kernel (stats_tile.py), the rest (small tensors, a tail) to the
    general kernel here; both merge into the row with atomics. `tune` is for benchmarks:
    kernel="general" (general kernel only), u, num_warps, progs_per_sm, sum32, parts, ballot,
    direct (False: launch through Triton's own launcher), fast, words, bytes, maxnreg, fparts,
    pref, wide (stats_tile.tile_consts)."""
    n = flat.numel()
    if n == 0:
        return
    if not flat.is_contiguous():  # the kernels read n consecutive elements from data_ptr
        raise ValueError("launch_row_stats needs a contiguous tensor (use dispatch.flat_view)")
    has_ptr = isinstance(scale, torch.Tensor)
    scale_ptr = scale if has_ptr else out_row  # unused when HAS_SCALE_PTR is False
    # a host scale made sane here (stats/scale.py): a float outside float32's range would also
    # reach the kernel as float64
    scale_val = 1.0 if has_ptr else effective_scale(scale)
    scaled = has_ptr or scale_val != 1.0
    cuda = flat.is_cuda and not _INTERPRET
    if tune is None and cuda:  # a kept plan: no decisions per call
        key = (flat.dtype, n, flat.device.index, has_ptr, scaled, flat.data_ptr() % 4 == 0)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= 4096:  # sizes that keep changing: start over
                _PLANS.clear()
            plan = _PLANS[key] = _RowPlan(flat, n, has_ptr, scaled, cuda, _NO_TUNE)
    else:
        plan = _RowPlan(flat, n, has_ptr, scaled, cuda, tune or _NO_TUNE)
    plan.run(flat, out_row, scale_ptr, scale_val)


_fast_general = FastLaunch(_row_stats_kernel)


class _RowPlan:
    """launch_row_stats' decisions for one kind of tensor (dtype, size, device, kind of scale,
    4-byte alignment) and one tuning. On a GPU with the default tuning it is kept and its
    launches go through launch.Bound (benchmarks/diagnose_record.py: ~6 us of host time less
    per record)."""

    def __init__(self, flat: torch.Tensor, n: int, has_ptr: bool, scaled: bool, cuda: bool,
                 tune: dict):
        from .stats_tile import _launch as tile_launch
        from .stats_tile import _tile_stats_kernel, tile_consts, tile_shape
        fp8 = self.fp8 = _FP8_CODE.get(flat.dtype, 0)
        index = flat.device.index
        direct = cuda and tune.get("direct", True)
        self.n_full, self.tile = 0, None
        warps = tune.get("num_warps", 4)
        shape = tile_shape(flat.element_size(), not cuda, warps, tune.get("u"))
        tile = shape[0] * shape[1] * shape[2]
        if tune.get("kernel") != "general" and n >= tile:
            self.n_full = n - n % tile
            tiles = self.n_full // tile
            # fp8 through its byte-count pass (tile_consts takes it when scaled too)
            bytes_ = fp8 in (1, 2) and (tune.get("bytes", self.n_full >= FP8_BYTES_MIN) or scaled)
            progs = (tile_programs(tiles, tile, _sm_count(index), tune.get("progs_per_sm", 4),
                                   tune.get("tiles_per_prog", 8)) if cuda else 4)
            self.tile_progs = min(tiles, progs)
            pref = tune.get("pref", prefetch_tiles(index, PREFETCH_AHEAD[bytes_ or fp8 == 3])
                            ) if cuda else 0
            consts, opts = tile_consts(
                flat.data_ptr() % 4 == 0, has_ptr, scaled, fp8, shape, tune.get("sum32", False),
                tune.get("parts", 3), tune.get("ballot", cuda), tune.get("fast", 2 if cuda else 1),
                tune.get("words", True), bytes_,
                tune.get("maxnreg", register_cap(fp8 == 3) if cuda else None), tune.get("fparts", 3),
                pref, tune.get("wide", wide_offsets(self.n_full, self.tile_progs * tile)))
            self.tile = (tile_launch.bind(consts, warps, **opts) if direct
                         else _triton_launch(_tile_stats_kernel, consts, warps, opts))
        self.n_tail, self.tail = n - self.n_full, None
        if self.n_tail:
            block, self.tail_progs = _launch_shape(self.n_tail, flat.device)
            consts = dict(FP8=fp8, HAS_SCALE_PTR=has_ptr, BLOCK=block)
            self.tail = (_fast_general.bind(consts, 4) if direct
                         else _triton_launch(_row_stats_kernel, consts, 4, {}))

    def run(self, flat: torch.Tensor, out_row: torch.Tensor, scale_ptr, scale_val: float):
        x = flat.view(_BITS_VIEW[self.fp8]) if self.fp8 else flat
        if self.tile is not None:
            self.tile(self.tile_progs, (x, out_row, scale_ptr, scale_val, self.n_full))
        if self.tail is not None:
            tail = x[self.n_full:] if self.n_full else x
            self.tail(self.tail_progs, (tail, x, out_row, scale_ptr, scale_val, self.n_tail))


def _triton_launch(fn, consts: dict, warps: int, opts: dict):
    # Triton's own launcher (the interpreter; tune={"direct": False}), called as launch.Bound is
    def launch(progs: int, args: tuple) -> None:
        fn[(progs,)](*args, **consts, num_warps=warps, **opts)
    return launch


_PLANS: dict = {}
# fp8's byte-count pass (tile_fp8.py) from 1 MiB of full tiles: with its epilogue summing the
# row's histogram before the atomics it is the faster pass from there (docs/kernels.md, "The fp8
# byte pass"). Scaled fp8 always takes it (the fast pass is for scale 1 only).
FP8_BYTES_MIN = 1 << 20
# Tiles ahead for the L2 prefetch: 4 for fp8's byte-count pass and bf16 (its table loads grouped
# ahead of its atomics), 2 for the others, where 4 is slower (docs/kernels.md, "Loads, grid and
# registers").
PREFETCH_AHEAD = {True: 4, False: 2}


def register_cap(bf16: bool) -> int:
    """The tile kernels' register cap: at most 128 registers (4 programs of 4 warps per SM, the
    grid tile_programs sizes), 96 for bf16 (more programs' loads in flight). Uncapped, the H200's
    ptxas gave the float32 kernel 145 (3 programs per SM: the fourth wave ran alone, +26 %)."""
    return 96 if bf16 else 128


def wide_offsets(n_full: int, step: int) -> bool:
    """Whether the tile kernel needs int64 element offsets: Triton passes an n_full below 2^31
    as int32, and the loops compute offsets up to ~10 grid steps (`step` elements each) past a
    tile start (the two-tile loop, its loads and the L2 prefetch ahead)."""
    return n_full + 12 * step >= 2**31


_NO_TUNE: dict = {}


def triton_row(flat: torch.Tensor, scale: "float | torch.Tensor" = 1.0) -> torch.Tensor:
    """A new statistics row for a flat tensor, computed by the kernel."""
    row = init_row_tensor(flat.device)
    assert row.dtype == ROW_DTYPE and row.numel() == N_STATS
    launch_row_stats(flat, row, scale)
    return row
