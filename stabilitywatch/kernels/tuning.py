"""How a tensor's statistics are launched: the tile shape, the grid, the register cap, the L2
prefetch and which pass the full tiles take, as the launchers decide them by default, and
`Tuning`, the typed set of choices that tests and benchmarks override.

Host code only (no jit functions): decisions about launches, made once per kind of tensor.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from .constants import Encoding, FastPass

# read once: the interpreter is on or off from the moment the @triton.jit functions are made
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# fp8's byte-count pass (tile_fp8.py) from 1 MiB of full tiles: with its epilogue summing the
# row's histogram before the atomics it is the faster pass from there (docs/kernels.md, "The fp8
# byte pass"). Scaled fp8 always takes it (the fast pass is for scale 1 only).
FP8_BYTES_MIN = 1 << 20
# Tiles ahead for the L2 prefetch: 4 for fp8's byte-count pass and bf16 (its table loads grouped
# ahead of its atomics), 2 for the others, where 4 is slower (docs/kernels.md, "Loads, grid and
# registers").
PREFETCH_AHEAD = {True: 4, False: 2}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch choices for `stats_triton.launch_row_stats`, for tests and benchmarks; a field left
    at None takes the launcher's default for the tensor and device. Every choice gives the same
    row (timing-only switches that do not: kernels/_timing.py)."""
    general_only: bool = False
    """Every element through the general kernel (no tile kernel)."""
    num_warps: int = 4
    """Warps per program of the tile kernel (T = 32 x num_warps threads)."""
    loads_per_thread: "int | None" = None
    """U, 16-byte loads per thread and tile (tile_shape); None: 2, 1 for fp8."""
    progs_per_sm: int = 4
    """At most this many tile-kernel programs per SM (tile_programs)."""
    tiles_per_prog: int = 8
    """Tiles per program the grid aims at (tile_programs)."""
    fast: "FastPass | None" = None
    """The pass over unscaled full tiles; None: LANE_HISTOGRAM on a GPU, TL_HISTOGRAM under the
    interpreter."""
    ballot: "bool | None" = None
    """The careful pass's histogram by warp vote (GPU only); None: on a GPU."""
    words: bool = True
    """bf16 read as 32-bit words, two values each (at a 4-byte aligned address)."""
    fp8_bytes: "bool | None" = None
    """fp8 through its byte-count pass; None: from FP8_BYTES_MIN elements in full tiles."""
    register_cap: "int | None" = None
    """maxnreg of the tile kernels with a fast pass; None: register_cap(); 0: no cap."""
    prefetch: "int | None" = None
    """L2 prefetch, tiles ahead (GPU, sm_90 and later); None: PREFETCH_AHEAD; 0: none."""
    wide: "bool | None" = None
    """int64 element offsets; None: wide_offsets()."""
    direct: bool = True
    """Launch through launch.Bound (False: Triton's own launcher)."""

    def __post_init__(self):
        for name in ("general_only", "words", "direct"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tuning.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("ballot", "fp8_bytes", "wide"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"Tuning.{name} must be None or a bool, got "
                                 f"{getattr(self, name)!r}")
        for name, lo in (("num_warps", 1), ("progs_per_sm", 1), ("tiles_per_prog", 1),
                         ("loads_per_thread", 1), ("register_cap", 0), ("prefetch", 0)):
            v = getattr(self, name)
            if v is None and name in ("loads_per_thread", "register_cap", "prefetch"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"Tuning.{name} must be an int >= {lo}, got {v!r}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"Tuning.num_warps must be a power of two, got {self.num_warps}")
        if self.fast is not None:
            try:
                object.__setattr__(self, "fast", FastPass(self.fast))
            except ValueError:
                raise ValueError(f"Tuning.fast must be a FastPass, got {self.fast!r}") from None


DEFAULT = Tuning()


def interpreting() -> bool:
    return INTERPRET


@functools.lru_cache(maxsize=None)
def sm_count(index: "int | None") -> int:
    # get_device_properties costs ~30 us per call, paid per launch without this cache
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def prefetch_tiles(index: "int | None", ahead: int) -> int:
    """`ahead` on devices whose PTX has the L2 bulk prefetch (ptx._l2_prefetch: sm_90 and
    later), else 0: the kernels must still compile on an A100 or an L4."""
    return ahead if torch.cuda.get_device_capability(index) >= (9, 0) else 0


def general_shape(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, programs) of the general kernel for n elements."""
    if INTERPRET or device.type != "cuda":
        # The interpreter pays per program and per loop step: few, wide programs.
        block, max_progs = 8192, 4
    else:
        block = 1024
        max_progs = sm_count(device.index) * 8
    return block, max(1, min(-(-n // block), max_progs))


def tile_shape(itemsize: int, interpreting: bool, num_warps: int = 4,
               u: "int | None" = None) -> tuple[int, int, int]:
    """(U, T, V): V elements per 16-byte load, T threads, U 16-byte loads per thread and tile."""
    v = 16 // itemsize
    if interpreting:  # few, wide programs; 8192-element tiles like the interpreter's blocks
        return 8192 // (256 * v), 256, v
    # two 16-byte loads per thread and tile for float32 and bf16, one for fp8: measured fastest
    # on the H200 (docs/kernels.md, "Loads, grid and registers")
    rows = u if isinstance(u, int) else 1 if v == 16 else 2
    return rows, 32 * num_warps, v


def tile_programs(tiles: int, tile: int, sms: int, per_sm: int = 4, per_prog: int = 8) -> int:
    """Programs for `tiles` tiles of `tile` elements. The fast passes end each program with a
    fixed epilogue (histogram readout, a few block-wide reductions, the row's atomics): several
    tiles per program, at least one program per SM. Their histogram packs 16-bit counts in words
    that lane L of every warp shares: at most 65535 values per word and program, tile // 32 of
    them per tile (past ~2^31 elements, more programs)."""
    progs = min(sms * per_sm, max(sms, tiles // per_prog))
    per_tile = tile // 32
    return max(progs, -(-tiles * per_tile // (65535 - per_tile)))


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


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The tile kernel's launch for one kind of tensor: its constexprs (in the kernel's
    parameter order), compile options and programs."""
    constexprs: dict
    options: dict
    num_warps: int
    programs: int


def tile_plan(tuning: Tuning, enc: Encoding, shape: tuple, n_full: int, programs: int,
              has_ptr: bool, scaled: bool, aligned4: bool, cuda: bool,
              l2_prefetch: bool) -> TilePlan:
    """The tile kernel's constexprs for n_full elements of full tiles in `programs` programs
    (aligned4: the tensor starts 4-byte aligned; l2_prefetch: the device has the L2 bulk
    prefetch, prefetch_tiles). Scaled fp8 takes the byte-count pass, other scaled tensors the
    careful pass; bf16 words need a 4-byte aligned start."""
    u, t, v = shape
    fast = tuning.fast if tuning.fast is not None else (
        FastPass.LANE_HISTOGRAM if cuda else FastPass.TL_HISTOGRAM)
    wants_bytes = (tuning.fp8_bytes if tuning.fp8_bytes is not None
                   else n_full >= FP8_BYTES_MIN)
    bytes_ = bool(fast and enc.is_fp8 and (wants_bytes or scaled))
    if scaled and not bytes_:
        fast = FastPass.OFF
    words = bool(fast and enc == Encoding.BF16 and tuning.words and aligned4)
    ballot = (tuning.ballot if tuning.ballot is not None else cuda) and not fast
    if not cuda:
        pref = 0
    elif tuning.prefetch is not None:
        pref = tuning.prefetch
    else:
        # fp8 at the byte pass's ahead whenever it would take that pass with a fast pass
        pref_bytes = enc.is_fp8 and (wants_bytes or scaled)
        pref = PREFETCH_AHEAD[pref_bytes or enc == Encoding.BF16] if l2_prefetch else 0
    wide = (tuning.wide if tuning.wide is not None
            else wide_offsets(n_full, programs * u * t * v))
    consts = dict(ENC=int(enc), SCALED=scaled, HAS_SCALE_PTR=has_ptr, U=u, T=t, V=v,
                  BALLOT=bool(ballot), FAST=int(fast), WORDS=words, BYTES=bytes_, PREF=pref,
                  WIDE=wide)
    # a register cap for the kernels with a fast pass (more programs per SM; their careful pass
    # runs under it too); the careful pass alone keeps what the compiler gives it
    cap = tuning.register_cap
    if cap is None:
        cap = register_cap(enc == Encoding.BF16) if cuda else 0
    opts = {"maxnreg": cap} if cap and fast else {}
    return TilePlan(consts, opts, tuning.num_warps, programs)
