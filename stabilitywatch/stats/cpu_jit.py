"""The CPU path's tallies in compiled loops (numba, stats/cpu_loops.py), where numba is
installed: per segment, one loop of integer work (|x| bits, the non-finite counts, the smallest
nonzero |x|, the fingerprint), one of the exponent counts, one of the float64 sums, and a
compare-and-add loop for each threshold whose exponent field holds values. stats/cpu.py turns
the tallies into rows as it does its numpy passes' (the same numbers: counts, extrema, histogram
and fingerprint bit for bit, sums to rounding); the extrema are numpy's (its min and max run in
vector lanes, numba's do not).

The first call of each work dtype compiles (seconds; numba caches the result on disk for the
next process). `warm()` compiles on a thread of its own; until it is done, `ready()` is False and
the numpy passes answer. The compiled loops release the GIL and run on the calling thread: no
thread of their own.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time
import warnings
from typing import NamedTuple, Optional

import numpy as np

from .cpu_work import _F32, _F64, _scratch, _thresholds

# numba is optional (the numpy passes answer without it), and imported only by the thread that
# compiles: `import stabilitywatch` does not pay for it. STABILITYWATCH_CPU_JIT=0: never compile.
ENABLED = (importlib.util.find_spec("numba") is not None
           and os.environ.get("STABILITYWATCH_CPU_JIT", "1") != "0")


class Tallies(NamedTuple):
    above: np.ndarray    # [nseg, len(tbits)] values whose |x| bits exceed each threshold
    fmt: Optional[np.ndarray]   # [nseg, len(fmt bits)] the same of |x * scale| (None at scale 1)
    ecount: np.ndarray   # [nseg, n_exp] values per exponent field of |x|
    ints: np.ndarray     # [nseg, 6] +Inf, zero and NaN counts, the smallest nonzero |x| bits
    #                      (inf when no finite value is nonzero), the fingerprint's 16-bit sums
    sums: np.ndarray     # [nseg, 3] sum, sum of squares, sum of squares of x - k (finite x)


_lock = threading.Lock()          # warm(): one compile thread per process
_import_lock = threading.Lock()   # _get(): held while numba imports; warm() never waits on it
_compiled = None
_ready: dict = {}    # work float type -> True once its loops are compiled
_warming = False
_failed = False      # a compile failed: the numpy passes answer for the rest of the process


def _after_fork_in_child() -> None:
    # a forked child has no compile thread, and a lock the thread held stays held in it: fresh
    # locks, and a compile of its own where the parent's had not finished
    global _lock, _import_lock, _warming
    _lock, _import_lock = threading.Lock(), threading.Lock()
    if not _failed and len(_ready) < 2:
        _warming = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _get():
    global _compiled
    with _import_lock:
        if _compiled is None:
            from . import cpu_loops
            _compiled = cpu_loops.run, cpu_loops.run_scaled
    return _compiled


def ready(float_type) -> bool:
    """True when the compiled loops of this work float type (np.float32 / np.float64) are
    compiled; never True without numba or with ENABLED set False."""
    return ENABLED and _ready.get(float_type, False)


def tallies(x: np.ndarray, starts: np.ndarray, k: np.ndarray, scale: float, w, th,
            sc) -> Tallies:
    """The tallies of segments x[starts[i]:starts[i+1]] at shifts k (w: the work, th: its
    thresholds, sc: the calling thread's scratch)."""
    run, run_scaled = _get()
    n, nseg = x.size, starts.size
    ends = np.empty(nseg, dtype=np.int64)
    ends[:-1] = starts[1:]
    ends[-1] = n
    tb, (t_exp, _, t_kind) = (th.both, th.plan_both) if scale == 1.0 else (th.x, th.plan_x)
    ints = np.empty((nseg, 6), dtype=np.int64)
    ecount = np.empty((nseg, w.n_exp), dtype=np.int64)
    sums = np.empty((nseg, 3), dtype=np.float64)
    counts = np.empty((nseg, tb.size), dtype=np.int64)
    run(x, x.view(w.int), starts, ends, np.ascontiguousarray(k, dtype=np.float64), w.int(w.mag),
        w.int(w.inf), w.int(w.exp_shift), w.int is np.int64, sc.ab, sc.lanes, tb, t_exp, t_kind,
        ints, ecount, sums, counts)
    fmt = None
    if scale != 1.0:
        y = sc.d.view(w.float) if w.int is np.int32 else sc.sq
        fmt = np.empty((nseg, th.fmt.size), dtype=np.int64)
        run_scaled(x, starts, ends, w.float(scale), y, y.view(w.int), th.fmt, fmt)
    return Tallies(counts, fmt, ecount, ints, sums)


def warm(works) -> None:
    """Compile the loops of each work (stats/cpu_work.py's _F32, _F64) on a thread of its own,
    once per process; ready() tells when each is done."""
    global _warming
    if not ENABLED or _warming:   # the common case, without the lock
        return
    with _lock:
        if _warming:
            return
        _warming = True
    try:
        threading.Thread(target=_compile, args=(tuple(works),), name="stabilitywatch-cpu-jit",
                         daemon=True).start()
    except Exception as e:   # noqa: BLE001 - e.g. no thread left to start: the numpy passes
        _give_up(e)


def _give_up(e: Exception) -> None:
    global _failed
    # the warning before the flag: wait() returns on the flag, and the warning must be out then
    warnings.warn(f"stabilitywatch: the compiled CPU statistics are off ({e!r}); the numpy "
                  "passes compute the rows", RuntimeWarning, stacklevel=2)
    _failed = True


def _compile(works) -> None:
    for w in works:
        try:
            x = np.zeros(8, dtype=w.float)
            for scale in (1.0, 2.0):
                tallies(x, np.array([0, 4], dtype=np.int64), np.zeros(2), scale, w,
                        _thresholds(w), _scratch(w))
        except Exception as e:   # noqa: BLE001 - a failed compile leaves the numpy passes
            _give_up(e)
            return
        _ready[w.float] = True


def wait(timeout: float = 120.0) -> bool:
    """Block until both works are compiled (tests, benchmarks, the demo); False without numba
    or when the compile failed."""
    if not ENABLED:
        return False
    warm((_F32, _F64))
    end = time.monotonic() + timeout
    while time.monotonic() < end and not _failed:
        if ready(np.float32) and ready(np.float64):
            return True
        time.sleep(0.01)
    return False
