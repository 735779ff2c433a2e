"""Exact and float64 sums of the CPU path (stats/cpu.py, stats/sentinel_cpu.py): the fingerprint's
16-bit halves in native uint64 adds, float64 sums and sums of squares by short BLAS dots."""
from __future__ import annotations

import numpy as np

_LANES = np.uint64(0x0000FFFF0000FFFF)


def halves(u: np.ndarray, work: np.ndarray) -> tuple:
    """(sum of the low 16 bits, sum of the high 16 bits) of up to 2^17 uint32 patterns, exact
    (`work`: a uint64 array of at least half their number).
    Read as uint64 words of two patterns, masked to the two halves wanted, each sum has a 32-bit
    lane of its own (below 2^16 x 2^16: no carry crosses), in native uint64 adds."""
    odd = u.size & 1
    words = u[: u.size - odd].view(np.uint64)
    t = work[: words.size]
    lo_hi = []
    for shift in (0, 16):
        src = words
        if shift:
            np.right_shift(words, np.uint64(shift), out=t)
            src = t
        np.bitwise_and(src, _LANES, out=t)
        total = int(np.add.reduce(t))
        lo_hi.append((total & 0xFFFFFFFF) + (total >> 32))
    if odd:
        last = int(u[-1])
        lo_hi[0] += last & 0xFFFF
        lo_hi[1] += last >> 16
    return lo_hi[0], lo_hi[1]


# values per float64 dot: OpenBLAS runs a dot this short on the calling thread (it may split
# longer ones over threads of its own); one dot reads its chunk once, where a product and a sum
# read and write it three times
DOT = 8192
ONES = np.ones(DOT)


def dots(d: np.ndarray, ones: "np.ndarray | None" = None) -> tuple:
    """(sum of d, sum of d^2) of a float64 array (the sum only when `ones` is given)."""
    s1 = s2 = 0.0
    for i in range(0, d.size, DOT):
        c = d[i: i + DOT]
        if ones is not None:
            s1 += float(np.dot(c, ones[: c.size]))
        s2 += float(np.dot(c, c))
    return s1, s2
