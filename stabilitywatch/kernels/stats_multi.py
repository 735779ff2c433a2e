"""Many tensors of one dtype in one launch: a pointer table on the device, a 2-D grid (tensor,
program), each program running the general kernel's body on its share of its tensor.

A step reads hundreds of small tensors at once (the parameters, gradients and optimizer state of
LayerNorms and biases): one launch each cost ~20-30 us of host time and a kernel's fixed GPU
time. Here the host builds one table (address, element count, row slot) per batch and makes one
launch, whatever the number of tensors. A table row also holds the address of the tensor's
first element (the shift, stats/layout.py): the tail of a large tensor starts past it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import ENCODING, N_ROW, Enc
from .launch import FastLaunch
from .stats_triton import _general_row
from .tuning import interpreting

_BLOCK = 1024
_PER_PROGRAM = 8 * _BLOCK  # elements per program, about


@triton.jit
def _multi_row_kernel(table_ptr, rows_ptr, ENC: tl.constexpr, HALF: tl.constexpr,
                      BLOCK: tl.constexpr):
    # the tensors of one dtype (constants.Encoding ENC; HALF: float16 rather than float32)
    i = tl.program_id(0)
    addr = tl.load(table_ptr + 4 * i)
    n = tl.load(table_ptr + 4 * i + 1)
    slot = tl.load(table_ptr + 4 * i + 2)
    kaddr = tl.load(table_ptr + 4 * i + 3)
    if ENC == Enc.FLOAT and not HALF:
        x_ptr = addr.to(tl.pointer_type(tl.float32))
        k_ptr = kaddr.to(tl.pointer_type(tl.float32))
    elif ENC == Enc.FLOAT:
        x_ptr = addr.to(tl.pointer_type(tl.float16))
        k_ptr = kaddr.to(tl.pointer_type(tl.float16))
    elif ENC == Enc.E4M3 or ENC == Enc.E5M2:
        x_ptr = addr.to(tl.pointer_type(tl.uint8))
        k_ptr = kaddr.to(tl.pointer_type(tl.uint8))
    else:
        x_ptr = addr.to(tl.pointer_type(tl.int16))
        k_ptr = kaddr.to(tl.pointer_type(tl.int16))
    _general_row(x_ptr, k_ptr, rows_ptr + slot * N_ROW, 1.0, n, tl.program_id(1),
                 tl.num_programs(1), ENC, BLOCK)


def _device_table(vals: list, device: torch.device, pin: bool) -> torch.Tensor:
    # int64 values on the device without a sync: the pinned buffer is kept by the caching host
    # allocator until the copy has run, and the copy is ordered before the launches that read it
    return torch.tensor(vals, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)


class ManyLaunch:
    """One multi-tensor launch, kept: its table holds addresses (no tensor references), valid
    while the same tensors keep their storage; `run(rows)` launches it again."""

    def __init__(self, flats: list, slots: list, device: torch.device,
                 k_offsets: "list | None" = None):
        # k_offsets[i]: bytes from the first element of flats[i]'s tensor to flats[i] (a tail)
        dtype = flats[0].dtype
        self.cuda = device.type == "cuda" and not interpreting()
        self.device = device
        self.koffs = list(k_offsets) if k_offsets is not None else [0] * len(flats)
        self.vals = []
        for f, s, o in zip(flats, slots, self.koffs):
            self.vals += (f.data_ptr(), f.numel(), s, f.data_ptr() - o)
        self.table = _device_table(self.vals, device, self.cuda)
        self.grid = (len(flats), max(1, min(32, -(-max(f.numel() for f in flats) // _PER_PROGRAM))))
        self.consts = dict(ENC=int(ENCODING[dtype]), HALF=dtype == torch.float16, BLOCK=_BLOCK)

    def rebind(self, addrs: list) -> bool:
        """The same launch on tensors like the first ones (same sizes, in the same order) at
        the addresses addrs: one table copy to the device, no host work per tensor."""
        self.vals[0::4] = addrs
        self.vals[3::4] = [a - o for a, o in zip(addrs, self.koffs)]
        self.table = _device_table(self.vals, self.device, self.cuda)
        return True

    def run(self, rows: torch.Tensor) -> None:
        if self.cuda:
            _launch(self.grid, (self.table, rows), self.consts, 4)
        else:  # the interpreter
            _multi_row_kernel[self.grid](self.table, rows, **self.consts)


def launch_many(flats: list, rows: torch.Tensor, slots: list,
                k_offsets: "list | None" = None) -> "ManyLaunch | None":
    """Merge the statistics of each 1-D contiguous tensor flats[k] (one dtype, on rows' device,
    each at most dispatch.MULTI_MAX elements) into rows[slots[k]] (scale 1). No host sync.
    k_offsets (ManyLaunch): where a flat is a tensor's tail. Returns the launch, to be run again
    on the same tensors."""
    if not flats:
        return None
    launch = ManyLaunch(flats, slots, rows.device, k_offsets)
    launch.run(rows)
    return launch


_launch = FastLaunch(_multi_row_kernel)
