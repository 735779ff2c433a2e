"""The CPU path's working parts (stats/cpu.py computes the rows with them): the work dtype of
each tensor dtype and its thresholds as bit patterns, the per-thread scratch buffers, the cached
segment layouts of a batch of tensors, and the load of a batch into one work array."""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

from ..formats import FORMATS, ROW_FORMATS
from .layout import FMT_BASE

# values per batch of passes: each batch costs ~0.12 ms of numpy calls whatever its size, and
# past 2^16 values a value costs about the same (the demo's step: 6 batches, not 12)
CHUNK = 1 << 17
# tensors up to SMALL values share passes with others, up to CHUNK values per batch
SMALL = 1 << 16


class _Work(NamedTuple):
    float: type      # numpy float type of the work
    int: type        # signed integer of the same width
    uint: type
    exp_shift: int   # the exponent field starts here
    exp_bias: int
    n_exp: int       # exponent field values
    inf: int         # bit pattern of +inf
    neginf: int      # ... of -inf, as the signed integer
    mag: int         # every bit but the sign
    mant: int        # the mantissa field


_F32 = _Work(np.float32, np.int32, np.uint32, 23, 127, 256, 0x7F800000, -0x00800000, 0x7FFFFFFF,
             (1 << 23) - 1)
_F64 = _Work(np.float64, np.int64, np.uint64, 52, 1023, 2048, 0x7FF0000000000000,
             -0x0010000000000000, 0x7FFFFFFFFFFFFFFF, (1 << 52) - 1)


class _Thresholds(NamedTuple):
    fmt: np.ndarray     # sorted bit patterns T of the format thresholds
    index: dict         # format -> (j_max, j_under, j_normal) into fmt
    x: np.ndarray       # x's own: nonzero (> 0), non-finite (> largest finite), NaN (> inf)
    both: np.ndarray    # fmt and x together, sorted (at scale 1 |y| is |x|: one set of passes)
    x_at: np.ndarray    # where x's and fmt's lie in both
    fmt_at: np.ndarray
    cols: np.ndarray    # per row format, its (j_max, j_under, j_normal) into fmt
    bases: np.ndarray   # per row format, its first column in the row
    plan_both: tuple    # _plan of both
    plan_x: tuple       # _plan of x


@functools.lru_cache(maxsize=2)
def _thresholds(w: _Work) -> _Thresholds:
    """For each format the indices j of fmt with "|y| > T[j]" meaning: overflow (> max), past
    underflow (> min_subnormal / 2), normal (>= subnormal_limit, that is > the pattern just
    below it)."""
    want = {}
    for fmt in ROW_FORMATS:
        f = FORMATS[fmt]
        bits = [int(np.array(v, dtype=w.float).view(w.int))
                for v in (f.max, f.underflow_threshold, f.subnormal_limit)]
        want[fmt] = (bits[0], bits[1], bits[2] - 1)
    t = sorted({b for v in want.values() for b in v})
    index = {fmt: tuple(t.index(b) for b in v) for fmt, v in want.items()}
    x = [0, w.inf - 1, w.inf]
    both = np.array(sorted(set(x) | set(t)), dtype=w.int)
    cols = np.array([index[fmt] for fmt in ROW_FORMATS], dtype=np.int64)   # [fmt, (max, under, normal)]
    return _Thresholds(np.array(t, dtype=w.int), index, np.array(x, dtype=w.int), both,
                       np.searchsorted(both, x), np.searchsorted(both, t), cols,
                       np.array([FMT_BASE[fmt] for fmt in ROW_FORMATS], dtype=np.int64),
                       _plan(both, w), _plan(np.array(x, dtype=w.int), w))


def _plan(tbits: np.ndarray, w: "_Work") -> tuple:
    # per threshold T: (index, T's exponent, T as a Python int, 0 = none of T's exponent lies
    # above it | 1 = all but those equal to it | 2 = compare)
    out = []
    for j, tb in enumerate(tbits.tolist()):   # sync-ok: numpy
        m = tb & w.mant
        out.append((j, tb >> w.exp_shift, tb, 0 if m == w.mant else 1 if m == 0 else 2))
    bins: dict = {}
    for j, e, tb, kind in out:
        if kind:
            bins.setdefault(e, []).append((j, tb, kind))
    # (exponents, bins of the thresholds that compare within theirs, each threshold's kind)
    return (np.array([e for _, e, _, _ in out], dtype=np.int64), list(bins.items()),
            np.array([kind for _, _, _, kind in out], dtype=np.int64))


def _work_of(dtype: torch.dtype) -> _Work:
    return _F64 if dtype == torch.float64 else _F32


class _Scratch:
    """Work arrays of one chunk, kept between calls: fresh arrays of this size come from the
    operating system page by page (~500 page faults per 65,536 values, three times the
    arithmetic)."""

    def __init__(self, w: _Work):
        self.x = np.empty(CHUNK, dtype=w.float)
        self.ab = np.empty(CHUNK, dtype=w.int)
        self.tmp = np.empty(CHUNK, dtype=w.int)
        # exponent fields: float64's in int16 (an int64 bincount reads 8 bytes a value, twice
        # the time), float32's in tmp itself (a shift into int32 costs half one into int16)
        self.ex = self.tmp if w.int is np.int32 else np.empty(CHUNK, dtype=np.int16)
        # float64 patterns folded to 32 bits for the fingerprint
        self.folded = np.empty(CHUNK if w.int is np.int64 else 0, dtype=np.uint32)
        # the compiled loops' exponent counts in four lanes (stats/cpu_loops.py), kept zeroed
        self.lanes = np.zeros((4, w.n_exp), dtype=np.int64)
        self.mask = np.empty(CHUNK, dtype=np.bool_)
        self.cls = np.empty(CHUNK, dtype=np.uint8)
        self.d = np.empty(CHUNK, dtype=np.float64)
        self.sq = np.empty(CHUNK, dtype=np.float64)
        self.idx = np.empty(CHUNK, dtype=np.int32)
        self.words = np.empty(CHUNK // 2, dtype=np.uint64)
        self.raw = torch.empty(CHUNK * 8, dtype=torch.uint8)   # small tensors, concatenated
        # segment layouts seen lately: the same tensors come back every sampled step
        self.layouts: dict = {}


class _Layout(NamedTuple):
    sizes: np.ndarray    # values per segment
    ebase: np.ndarray    # int32: each value's segment times n_exp, its first exponent-count bin
    spans: list          # (start, size) of each segment, as Python ints


# layouts kept per thread and work dtype: up to 4 bytes a value, 8 MiB at most
_LAYOUTS = 16


def _layout(starts: np.ndarray, n: int, w: _Work, sc: _Scratch) -> _Layout:
    key = (n, starts.tobytes())
    got = sc.layouts.get(key)
    if got is None:
        sizes = np.diff(np.append(starts, n))
        # int32 throughout: at most CHUNK segments of at most 2048 exponents each
        ebase = np.repeat(np.arange(0, starts.size * w.n_exp, w.n_exp, dtype=np.int32), sizes)
        got = _Layout(sizes, ebase, list(zip(starts.tolist(), sizes.tolist())))  # sync-ok: numpy
        if len(sc.layouts) >= _LAYOUTS:
            sc.layouts.pop(next(iter(sc.layouts)))
        sc.layouts[key] = got
    return got


_local = threading.local()


def _scratch(w: _Work) -> _Scratch:
    # one set per thread and work dtype: calls on other threads never share one
    have = getattr(_local, "scratch", None)
    if have is None:
        have = _local.scratch = {}
    if w.int not in have:
        have[w.int] = _Scratch(w)
    return have[w.int]


def _load(parts: list, w: _Work, sc: _Scratch) -> np.ndarray:
    """The values of the tensors in parts one after the other, in the work dtype (a view of the
    tensor itself when it already is one contiguous tensor of the work dtype)."""
    n = sum(p.numel() for p in parts)
    if len(parts) == 1:
        src = parts[0].detach().resolve_neg()
        if src.dtype == (torch.float64 if w is _F64 else torch.float32) and src.is_contiguous():
            return host_view(src.reshape(-1))
    else:
        dtype = parts[0].dtype
        flat = [p.detach().resolve_neg().reshape(-1) for p in parts]
        if dtype == (torch.float64 if w is _F64 else torch.float32):
            x = sc.x[:n]   # one copy: straight into the work array
            torch.cat(flat, out=torch.from_numpy(x))
            return x
        staged = sc.raw[: n * parts[0].element_size()].view(dtype)
        src = torch.cat(flat, out=staged)
    x = sc.x[:n]
    if src.dtype == torch.float8_e4m3fn:
        # torch widens e4m3 one value at a time (~4 ns each; e5m2, a shortened float16, in
        # vector code): a gather from the float32 values of its 256 patterns costs a sixth
        np.take(_E4M3, host_view(src.contiguous().view(torch.uint8).reshape(-1)), out=x,
                mode="clip")
        return x
    torch.from_numpy(x).view(src.shape).copy_(src)
    return x


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (DLPack: shared, writable). CPU memory is read in
    place; there is no device to wait for."""
    return np.from_dlpack(t.detach())


# the float32 value of each e4m3 bit pattern, by torch's own conversion (at import, on the CPU)
_E4M3 = host_view(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(
    torch.float32))
