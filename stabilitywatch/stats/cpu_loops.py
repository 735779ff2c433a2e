"""The compiled loops of stats/cpu_jit.py (numba, cached on disk). Imported only where numba
is installed, on the thread that compiles them.

Each loop takes its segment as views (`x[a:b]`) and counts from 0: an index that could be
negative costs a wrap-around check per read, and the check keeps the loop out of vector lanes.
"""
import numba
import numpy as np

jit = numba.njit(cache=True, nogil=True)


@jit
def integers(xb, mag, inf, fold, ab, out):
    # |x| bits into ab; out: +Inf, zero and NaN counts, the smallest nonzero |x| bits (inf
    # when no finite value is nonzero), the fingerprint's low and high 16-bit sums. Integer
    # work only: it runs in vector lanes.
    lo = hi = npos = zeros = nan = 0
    small = inf
    for i in range(xb.size):
        bits = xb[i]
        m = bits & mag
        ab[i] = m
        npos += np.int64(bits == inf)
        zeros += np.int64(m == 0)
        nan += np.int64(m > inf)
        small = min(small, m if m != 0 else inf)
        u = np.int64(0x7FC00000) if m > inf else np.int64(bits)
        if fold:   # float64: the XOR of the pattern's two 32-bit halves
            u = u ^ (u >> 32)
        u &= 0xFFFFFFFF
        lo += u & 0xFFFF
        hi += u >> 16
    out[0], out[1], out[2], out[3], out[4], out[5] = npos, zeros, nan, small, lo, hi


@jit
def histogram(ab, shift, lanes, ecount):
    # four lanes of counts: consecutive values of one field do not wait on each other
    n = ab.size // 4 * 4
    for i in range(0, n, 4):
        lanes[0, ab[i] >> shift] += 1
        lanes[1, ab[i + 1] >> shift] += 1
        lanes[2, ab[i + 2] >> shift] += 1
        lanes[3, ab[i + 3] >> shift] += 1
    for i in range(n, ab.size):
        lanes[0, ab[i] >> shift] += 1
    for e in range(ecount.size):
        ecount[e] = lanes[0, e] + lanes[1, e] + lanes[2, e] + lanes[3, e]
        lanes[0, e] = lanes[1, e] = lanes[2, e] = lanes[3, e] = 0


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def sums(x, ab, inf, k, out):
    # float64 sums of the finite values, reassociated into vector lanes (rounding differs from
    # one sequential sum by no more than another order does)
    s1 = s2 = s3 = 0.0
    for i in range(x.size):
        fin = ab[i] < inf
        v = np.float64(x[i]) if fin else 0.0
        s1 += v
        s2 += v * v
        d = v - k if fin else 0.0
        s3 += d * d
    out[0], out[1], out[2] = s1, s2, s3


@jit
def count_above(bits, t):
    c = 0
    for i in range(bits.size):
        c += np.int64(bits[i] > t)
    return c


@jit
def above(bits, tbits, t_exp, t_kind, ecount, inf, ints, out):
    # values whose bits exceed each threshold T: those of higher exponent fields from the
    # counts; the nonzero values (T = 0) and the NaNs (T = inf) from the integer loop's counts;
    # otherwise, when T's own field holds values and T is not its largest pattern (kind not
    # 0: stats/cpu_work.py's _plan), one compare-and-add pass
    beyond = 0
    e = ecount.size - 1
    for j in range(tbits.size - 1, -1, -1):   # thresholds ascending: fields descending
        while e > t_exp[j]:
            beyond += ecount[e]
            e -= 1
        t = tbits[j]
        if t == 0:
            out[j] = bits.size - ints[1]
        elif t == inf:
            out[j] = ints[2]
        elif t_kind[j] and ecount[t_exp[j]]:
            out[j] = count_above(bits, t)
        else:
            out[j] = beyond


@jit
def scaled_abs(x, scale, y):
    for i in range(x.size):
        y[i] = abs(x[i] * scale)


@jit
def run(x, xb, starts, ends, k, mag, inf, shift, fold, ab, lanes, tbits, t_exp, t_kind, ints,
        ecount, sumsout, counts):
    for s in range(starts.size):
        a, b = starts[s], ends[s]
        abs_ = ab[a:b]
        integers(xb[a:b], mag, inf, fold, abs_, ints[s])
        histogram(abs_, shift, lanes, ecount[s])
        sums(x[a:b], abs_, inf, k[s], sumsout[s])
        above(abs_, tbits, t_exp, t_kind, ecount[s], inf, ints[s], counts[s])


@jit
def run_scaled(x, starts, ends, scale, y, yb, tbits, counts):
    # the format thresholds of |x * scale|: one pass each (no exponent counts of y)
    for s in range(starts.size):
        a, b = starts[s], ends[s]
        scaled_abs(x[a:b], scale, y[a:b])
        for j in range(tbits.size):
            counts[s, j] = count_above(yb[a:b], tbits[j])
