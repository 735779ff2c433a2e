"""The every-step gradient sentinel (Triton): jit kernel, launcher, public function.

One launch reads every parameter gradient of a dtype on a device once and writes, per
gradient, the non-finite count, the largest finite |x| and the sum of squares of the finite
values into a float64 [n, 3] device tensor (stats/sentinel.py holds the pure-torch twin). Each
program reads one chunk of one gradient: a table maps the program to (tensor, chunk); a second,
per-tensor table holds (address, element count, output row). Gradients set to None come back at
other addresses: `rebind` rewrites the per-tensor table only (one small copy to the device).
Partial results go to the row with atomics (float64 adds; the absmax as the int64 bit pattern of
a non-negative double, whose integer order is the float order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..stats.sentinel import COLS
from .launch import FastLaunch
from .stats_multi import _device_table
from .stats_triton import _interpreting

ROW = tl.constexpr(COLS)      # a jit function reads module globals only as constexprs

# how the program reads its tensor: 0 float32, 1 float16, 3 bf16 (as 16-bit words: the
# interpreter's bf16 cast is wrong for subnormals; the shift is exact and free on the GPU)
ELT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 3}
KERNEL_DTYPES = tuple(ELT)
BLOCK = 2048                  # elements per loop step of a program
ITERS = 32                    # loop steps per chunk: a chunk is 64 Ki elements (256 KiB fp32)
INTERP_BLOCK, INTERP_ITERS = 4096, 2   # the interpreter pays per program and per loop step


@triton.jit
def _chunk(x_ptr, start, n, lanes, ELT_: tl.constexpr, BLOCK_: tl.constexpr,
           ITERS_: tl.constexpr, MASKED: tl.constexpr):
    # per-lane partials of one chunk; the full chunks go unmasked (a mask against a loaded
    # length would keep the loads from being vectorised)
    bad = tl.zeros([BLOCK_], dtype=tl.int32)
    nan = tl.zeros([BLOCK_], dtype=tl.int32)
    amax = tl.zeros([BLOCK_], dtype=tl.float32)
    # float64 squares: |x| above 2^64 (finite in fp32 and bf16) squares to inf in float32
    ss = tl.zeros([BLOCK_], dtype=tl.float64)
    for i in range(ITERS_):
        idx = start + i * BLOCK_ + lanes
        if MASKED:
            m = idx < n
            if ELT_ == 3:
                w = tl.load(x_ptr + idx, mask=m, other=0).to(tl.int32)
            else:
                x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
        else:
            if ELT_ == 3:
                w = tl.load(x_ptr + idx).to(tl.int32)
            else:
                x = tl.load(x_ptr + idx).to(tl.float32)
        if ELT_ == 3:
            x = ((w & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        a = tl.abs(x)
        fin = a < float("inf")        # False for NaN and +-Inf
        bad += tl.where(fin, 0, 1)
        nan += tl.where(x != x, 1, 0)
        a = tl.where(fin, a, 0.0)
        amax = tl.maximum(amax, a)
        a64 = a.to(tl.float64)
        ss += a64 * a64
    return bad, nan, amax, ss


@triton.jit
def _sentinel_kernel(table_ptr, chunk_ptr, out_ptr, ELT_: tl.constexpr, BLOCK_: tl.constexpr,
                     ITERS_: tl.constexpr):
    c = tl.program_id(0)
    k = tl.load(chunk_ptr + 2 * c)
    j = tl.load(chunk_ptr + 2 * c + 1).to(tl.int64)
    addr = tl.load(table_ptr + 3 * k)
    n = tl.load(table_ptr + 3 * k + 1)
    slot = tl.load(table_ptr + 3 * k + 2)
    if ELT_ == 0:
        x_ptr = addr.to(tl.pointer_type(tl.float32))
    elif ELT_ == 1:
        x_ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        x_ptr = addr.to(tl.pointer_type(tl.int16))
    x_ptr = tl.multiple_of(x_ptr, 16)
    lanes = tl.arange(0, BLOCK_)
    start = j * (BLOCK_ * ITERS_)
    if start + BLOCK_ * ITERS_ <= n:
        bad, nan, amax, ss = _chunk(x_ptr, start, n, lanes, ELT_, BLOCK_, ITERS_, False)
    else:
        bad, nan, amax, ss = _chunk(x_ptr, start, n, lanes, ELT_, BLOCK_, ITERS_, True)
    row = out_ptr + slot * ROW
    tl.atomic_add(row, tl.sum(bad, axis=0).to(tl.float64), sem="relaxed")
    top = tl.max(amax, axis=0).to(tl.float64).to(tl.int64, bitcast=True)
    tl.atomic_max(row.to(tl.pointer_type(tl.int64)) + 1, top, sem="relaxed")
    tl.atomic_add(row + 2, tl.sum(ss, axis=0).to(tl.float64), sem="relaxed")
    tl.atomic_add(row + 3, tl.sum(nan, axis=0).to(tl.float64), sem="relaxed")


class SentinelLaunch:
    """One launch over several gradients of one dtype on one device, kept: its tables hold
    addresses (no tensor references), valid while the tensors keep their storage."""

    def __init__(self, flats: list, slots: list, device: torch.device,
                 block: "int | None" = None, iters: "int | None" = None):
        dtype = flats[0].dtype
        self.cuda = device.type == "cuda" and not _interpreting()
        self.device = device
        blk = block or (BLOCK if self.cuda else INTERP_BLOCK)
        its = iters or (ITERS if self.cuda else INTERP_ITERS)
        chunk = blk * its
        self.vals, progs = [], []
        for k, (f, s) in enumerate(zip(flats, slots)):
            self.vals += (f.data_ptr(), f.numel(), s)
            progs += [x for p in range(-(-f.numel() // chunk)) for x in (k, p)]
        self.table = _device_table(self.vals, device, self.cuda)
        self.chunks = torch.tensor(progs, dtype=torch.int32, pin_memory=self.cuda).to(
            device, non_blocking=True)
        self.grid = len(progs) // 2
        self.consts = dict(ELT_=ELT[dtype], BLOCK_=blk, ITERS_=its)
        self.warps = 8 if self.cuda else 4
        self._bound = _launch.bind(self.consts, self.warps) if self.cuda else None

    def rebind(self, addrs: list) -> bool:
        """The same launch on tensors like the first ones (sizes, order) at new addresses."""
        if any(a % 16 for a in addrs):
            return False
        self.vals[0::3] = addrs
        self.table = _device_table(self.vals, self.device, self.cuda)
        return True

    def run(self, out: torch.Tensor) -> None:
        if self.grid == 0:
            return
        if self.cuda:
            self._bound(self.grid, (self.table, self.chunks, out))
        else:  # the interpreter
            _sentinel_kernel[(self.grid,)](self.table, self.chunks, out, **self.consts,
                                           num_warps=self.warps)


def launchable(t: torch.Tensor) -> bool:
    """True when the kernel can read t in place: a kernel dtype, dense, 16-byte aligned, and
    not a CUDA tensor under the interpreter (which would read device addresses on the host)."""
    from .dispatch import _interpret, viewable
    return (t.dtype in ELT and t.numel() > 0 and viewable(t) and t.data_ptr() % 16 == 0
            and not (t.is_cuda and _interpret()))


def sentinel_launch(flats: list, out: torch.Tensor, slots: list) -> SentinelLaunch:
    """Write the sentinel of each 1-D tensor flats[k] (one dtype, each launchable()) into
    out[slots[k]] (float64 [n, 4], zeroed by the caller). No host sync. Returns the launch, to
    run again on the same tensors or to rebind to new addresses."""
    launch = SentinelLaunch(flats, slots, out.device)
    launch.run(out)
    return launch


_launch = FastLaunch(_sentinel_kernel)
