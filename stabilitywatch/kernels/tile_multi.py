"""Many large tensors of one dtype in one launch of the tile kernel's passes.

The taps over parameters read ~50 tensors of 0.5-40 M elements per role each sampled step
(weights, gradients, Adam's two states): one launch each cost ~9-16 us of GPU time for a few
MB (the launch gap, a grid's ramp and tail, each program's epilogue), ~2.5 ms per sampled step
for GPT-2 small against ~0.5 ms of bytes. Here one grid holds every program of every tensor: a
table maps each program to its tensor (address, full-tile elements, row slot, programs of that
tensor) and to its index among them; each runs the fast pass (or the careful pass, for data the
fast pass cannot count) on its share of its tensor, as stats_tile does for one tensor. The tails
(elements past the last full tile) go to stats_multi's launch with the small tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import ALL_PARTS, ENCODING, HBINS, N_ROW, Enc, Row
from .launch import FastLaunch
from .row_ops import _claim_shift, _emit_scalars, _load_shift
from .stats_multi import _device_table
from .stats_tile import _careful_tiles
from .tile_fast import _fast_tiles
from .tuning import (PREFETCH_AHEAD, interpreting, prefetch_tiles, register_cap, sm_count,
                     tile_programs, tile_shape)


@triton.jit
def _multi_tile_kernel(table_ptr, prog_ptr, rows_ptr, ENC: tl.constexpr, HALF: tl.constexpr,
                       U: tl.constexpr, T: tl.constexpr, V: tl.constexpr, LANE: tl.constexpr,
                       WORDS: tl.constexpr, PREF: tl.constexpr):
    # the tensors of one dtype (constants.Encoding ENC, FLOAT or BF16; HALF: float16 rather
    # than float32); LANE, WORDS, PREF as in stats_tile._tile_stats_kernel
    g = tl.program_id(0)
    k = tl.load(prog_ptr + 2 * g)
    pid = tl.load(prog_ptr + 2 * g + 1)
    addr = tl.load(table_ptr + 4 * k)
    n_full = tl.load(table_ptr + 4 * k + 1)
    slot = tl.load(table_ptr + 4 * k + 2)
    nprog = tl.load(table_ptr + 4 * k + 3).to(tl.int32)
    if ENC == Enc.FLOAT and not HALF:
        x_ptr = addr.to(tl.pointer_type(tl.float32))
    elif ENC == Enc.FLOAT:
        x_ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        x_ptr = addr.to(tl.pointer_type(tl.int16))
    # 16-byte aligned (dispatch.tileable): vector loads. The hint must follow a cast made here:
    # on the result of a helper's cast (stats_multi has the same four lines) it is lost
    x_ptr = tl.multiple_of(x_ptr, 16)
    out_ptr = rows_ptr + slot * N_ROW
    lanes = tl.arange(0, U * T * V)
    hc0 = tl.zeros([T], dtype=tl.int32)  # the careful pass's ballot counts: off here
    hc1 = hc0
    e0 = pid * 0
    # the shift: the tensor's first element (its full tiles start there; its tail, in
    # stats_multi's launch, loads the same element)
    kp = _load_shift(x_ptr, ENC)
    krow = _claim_shift(out_ptr, kp)
    clean, v, hist = _fast_tiles(x_ptr, n_full, pid, nprog, lanes, kp, krow, ENC, U, T, V, LANE,
                                 WORDS, PREF, False, ALL_PARTS)
    if clean == 0:  # scale 1, no warp-vote histogram
        v, hist, hc0, hc1, e0 = _careful_tiles(x_ptr, 1.0, n_full, pid, nprog, lanes, kp, krow,
                                               ENC, False, U, T, V, False, PREF, False, ALL_PARTS)
    _emit_scalars(out_ptr, tl.arange(0, 32), v)
    bins = tl.arange(0, HBINS)
    tl.atomic_add(out_ptr + Row.HIST + bins, hist.to(tl.float64), mask=hist != 0,
                  sem="relaxed")


# Tiles per program in a multi-tensor launch (tile_programs). Each program zeroes and reads back
# its lane histogram and threshold table (43.25 KiB): with 8 tiles (32 KiB of float32) that is
# more than its data. GPT-2 small's weights on the H200, by tiles per program:
# docs/kernels.md, "Multi-tensor launches" (benchmarks/RESULTS.md, "Multi-tensor launch").
TILES_PER_PROG = 32


class TileManyLaunch:
    """One launch over the full tiles of several tensors of one dtype, kept: its tables hold
    addresses (no tensor references), valid while the tensors keep their storage."""

    def __init__(self, flats: list, slots: list, device: torch.device,
                 per_prog: "int | None" = None):
        dtype = flats[0].dtype
        self.cuda = device.type == "cuda" and not interpreting()
        u, t, v = self.shape = tile_shape(dtype.itemsize, not self.cuda)
        tile = u * t * v
        sms = sm_count(device.index) if self.cuda else 1
        self.device = device
        table, progs = [], []
        for k, (f, s) in enumerate(zip(flats, slots)):
            tiles = f.numel() // tile
            # ~TILES_PER_PROG tiles per program (the grid is shared: no tensor needs a program
            # per SM), at most 4 per SM, and within the 16-bit histogram counts (tile_programs)
            n = min(tiles, tile_programs(tiles, tile, 1, 4 * sms, per_prog or TILES_PER_PROG)
                    if self.cuda else 4)
            table += (f.data_ptr(), tiles * tile, s, n)
            progs += [x for p in range(n) for x in (k, p)]
        self.vals = table
        self.table = _device_table(table, device, self.cuda)
        self.progs = torch.tensor(progs, dtype=torch.int32, pin_memory=self.cuda).to(
            device, non_blocking=True)
        self.grid = len(progs) // 2
        words = dtype == torch.bfloat16 and all(f.data_ptr() % 4 == 0 for f in flats)
        self.consts = dict(ENC=int(ENCODING[dtype]), HALF=dtype == torch.float16, U=u, T=t, V=v,
                           LANE=self.cuda, WORDS=words,
                           PREF=prefetch_tiles(device.index, PREFETCH_AHEAD[words])
                           if self.cuda else 0)
        self.opts = {"maxnreg": register_cap(dtype == torch.bfloat16)} if self.cuda else {}

    def rebind(self, addrs: list) -> bool:
        """As stats_multi.ManyLaunch.rebind; False (nothing changed) when an address is not
        16-byte aligned (dispatch.tileable), which the vector loads need."""
        if any(a % 16 for a in addrs):
            return False
        self.vals[0::4] = addrs
        self.table = _device_table(self.vals, self.device, self.cuda)
        return True

    def run(self, rows: torch.Tensor) -> None:
        if self.cuda:
            _launch(self.grid, (self.table, self.progs, rows), self.consts, 4, **self.opts)
        else:  # the interpreter
            _multi_tile_kernel[(self.grid,)](self.table, self.progs, rows, **self.consts,
                                            num_warps=4)


def full_tiles(t: torch.Tensor) -> int:
    """Elements of the flat tensor t that lie in full tiles of the tile kernel."""
    u, tt, v = tile_shape(t.element_size(), t.device.type != "cuda" or interpreting())
    return t.numel() - t.numel() % (u * tt * v)


_launch = FastLaunch(_multi_tile_kernel)
