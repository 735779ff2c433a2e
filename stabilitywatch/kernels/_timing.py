"""A timing variant of the tile kernel, for benchmarks: the same passes with parts switched
off, to see where the time goes. The rows it writes are wrong unless every part is on; the
production kernel (stats_tile._tile_stats_kernel) has none of these switches.

    from stabilitywatch.kernels._timing import Timing, launch_timed
    launch_timed(flat, row, Timing(fast_parts=PART_COUNTS))   # the fast pass, no histogram
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .constants import ALL_PARTS
from .launch import FastLaunch
from .stats_tile import _merge_tile_row, _tile_passes
from .stats_triton import run_row_stats
from .tuning import Tuning


@triton.jit(do_not_specialize=["n_full"])
def _tile_timing_kernel(x_ptr, out_ptr, scale_ptr, scale_val, n_full,
                        ENC: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
                        U: tl.constexpr, T: tl.constexpr, V: tl.constexpr,
                        BALLOT: tl.constexpr, FAST: tl.constexpr, WORDS: tl.constexpr,
                        BYTES: tl.constexpr, PREF: tl.constexpr, WIDE: tl.constexpr,
                        SUM32: tl.constexpr, CAREFUL_PARTS: tl.constexpr,
                        FAST_PARTS: tl.constexpr, ROW_WRITES: tl.constexpr):
    v, hist, hc0, hc1, e0 = _tile_passes(x_ptr, out_ptr, scale_ptr, scale_val, n_full, ENC,
                                         SCALED, HAS_SCALE_PTR, U, T, V, BALLOT, FAST, WORDS,
                                         BYTES, PREF, WIDE, SUM32, CAREFUL_PARTS, FAST_PARTS)
    if ROW_WRITES:
        _merge_tile_row(out_ptr, v, hist, hc0, hc1, e0, T, BALLOT, FAST)
    else:  # a store that never happens keeps the compiler from dropping the work
        keep = (tl.sum(v, 0) + tl.sum(hist, 0).to(tl.float64)
                + tl.sum(hc0 + hc1, 0).to(tl.float64))
        tl.store(out_ptr, keep, mask=keep == -1.2345e300)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Timing-only switches of the tile kernel's passes (constants.PART_COUNTS, PART_HIST)."""
    sum32: bool = False
    """float32 sums within a tile (float64 across tiles)."""
    careful_parts: int = int(ALL_PARTS)
    """The careful pass's parts: PART_COUNTS the format counts, PART_HIST the histogram."""
    fast_parts: int = int(ALL_PARTS)
    """The fast pass's (threshold counts, histogram) and the fp8 byte pass's (scalar fields,
    histogram) parts."""
    row_writes: bool = True
    """False: no atomics into the row at all."""

    def __post_init__(self):
        for name in ("careful_parts", "fast_parts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= int(ALL_PARTS):
                raise ValueError(f"Timing.{name} must be an int in 0..{int(ALL_PARTS)}, "
                                 f"got {v!r}")
        for name in ("sum32", "row_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Timing.{name} must be a bool, got {getattr(self, name)!r}")

    def constexprs(self) -> dict:
        return dict(SUM32=self.sum32, CAREFUL_PARTS=self.careful_parts,
                    FAST_PARTS=self.fast_parts, ROW_WRITES=self.row_writes)


def launch_timed(flat: torch.Tensor, out_row: torch.Tensor, timing: Timing,
                 tuning: "Tuning | None" = None, scale: "float | torch.Tensor" = 1.0) -> None:
    """stats_triton.launch_row_stats with the timing kernel for the full tiles (the tail
    through the general kernel as usual)."""
    run_row_stats(flat, out_row, scale, tuning,
                  (_tile_timing_kernel, timing.constexprs(), _launch))


_launch = FastLaunch(_tile_timing_kernel)
