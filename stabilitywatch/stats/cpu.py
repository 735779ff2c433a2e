"""Statistics rows of CPU tensors in a few vectorised passes: the CPU path.

stats/reference.py (the oracle) makes ~60 torch calls per tensor; here each value is read by the
compiled loops of stats/cpu_jit.py (numba: four loops per tensor) or, while they compile and
where numba is absent, by ~20 numpy passes, over chunks that stay in cache; many small tensors
share the same passes (one concatenation; per-tensor results by segment). Both gather the same
tallies, which one assembly (_fill_counts and the lines around it) turns into rows. The numbers
are the reference's: counts, extrema, histogram and fingerprint bit for bit, sums to rounding
(float64, another summation order).

How: with its sign cleared, a float's bit pattern orders like its magnitude, so every count is
an integer comparison of bit patterns against a threshold's bit pattern (the threshold cast to
the work dtype, as torch casts a Python scalar). The exponent histogram is a count of the
exponent field: zeros land in its first bin and Inf/NaN in its last, and their counts come back
out; it also answers every threshold whose own exponent field holds no values.

Values work in float32 (float64 tensors in float64), as in the reference. The loops and numpy
run on the calling thread (numpy's BLAS dots are short enough that OpenBLAS does not split them
over its own threads); the upcast to float32 runs in torch, on torch's threads. CPU memory is
host memory: nothing here waits for a device.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .layout import HIST_BINS, HIST_EMIN, N_STATS, Stat, init_row, merge_rows
from .reference import SUPPORTED_DTYPES
from .cpu_merge import merge_at, merge_host  # noqa: F401 (the CPU path's row merges)
from . import cpu_jit
from .cpu_sums import dots, halves
from .scale import effective_scale

# the working parts; CHUNK, SMALL, host_view and the scratch are the CPU stage's too
from .cpu_work import (_F32, _F64, CHUNK, SMALL, _layout, _load, _Scratch,  # noqa: F401
                       _scratch, _thresholds, _Work, _work_of, host_view)


# up to this many segments, each one's sums are short dots over its own values (a few calls per
# segment); beyond, whole-array products and segment sums
FEW_SEGMENTS = 32


def _bincount(idx: np.ndarray, n: int) -> np.ndarray:
    # torch's bincount reads small integers about twice as fast as numpy's
    return host_view(torch.bincount(torch.from_numpy(idx), minlength=n))


def _rows(x: np.ndarray, starts: np.ndarray, k: np.ndarray, scale: float, w: _Work,
          sc: _Scratch) -> np.ndarray:
    """Rows of the segments x[starts[i]:starts[i+1]] (each nonempty), at shifts k: by the
    compiled loops once they are compiled, by numpy passes until then or without numba."""
    if cpu_jit.ready(w.float):
        return _rows_compiled(x, starts, k, scale, w, sc)
    cpu_jit.warm((_F32, _F64))
    return _rows_numpy(x, starts, k, scale, w, sc)


def _rows_compiled(x: np.ndarray, starts: np.ndarray, k: np.ndarray, scale: float, w: _Work,
                   sc: _Scratch) -> np.ndarray:
    th = _thresholds(w)
    t = cpu_jit.tallies(x, starts, k, scale, w, th, sc)
    nseg = starts.size
    sizes = np.diff(np.append(starts, x.size)).astype(np.float64)
    out = np.zeros((nseg, N_STATS), dtype=np.float64)
    above = t.above.astype(np.float64)
    if scale == 1.0:
        ax, af = above[:, th.x_at], above[:, th.fmt_at]
    else:
        ax, af = above, t.fmt.astype(np.float64)
    ints = t.ints
    _, nonfinite, finite = _fill_counts(out, ax, af, ints[:, 0].astype(np.float64),
                                        t.ecount.astype(np.float64), sizes, scale, th, w)
    out[:, Stat.ABSMIN_NZ] = ints[:, 3].astype(w.int).view(w.float)
    # extrema of the finite values: numpy's min and max run in vector lanes, numba's do not
    if not nonfinite.any():
        if nseg == 1:
            mn, mx = np.minimum.reduce(x)[None], np.maximum.reduce(x)[None]
        else:
            mn, mx = np.minimum.reduceat(x, starts), np.maximum.reduceat(x, starts)
    else:
        fin = sc.ab[: x.size] < w.inf
        lo_x, hi_x = np.where(fin, x, np.inf), np.where(fin, x, -np.inf)
        mn, mx = np.minimum.reduceat(lo_x, starts), np.maximum.reduceat(hi_x, starts)
    out[:, Stat.MIN], out[:, Stat.MAX] = mn, mx
    out[:, Stat.ABSMAX] = np.maximum(-mn.astype(np.float64), mx)
    out[:, Stat.SUM], out[:, Stat.SUMSQ], out[:, Stat.SHIFT_SUMSQ] = t.sums.T
    out[:, Stat.SHIFT] = k
    out[:, Stat.SHIFT_SUM] = out[:, Stat.SUM] - finite * k
    out[:, Stat.BITS_LO], out[:, Stat.BITS_HI] = ints[:, 4], ints[:, 5]
    return out


def _rows_numpy(x: np.ndarray, starts: np.ndarray, k: np.ndarray, scale: float, w: _Work,
                sc: _Scratch) -> np.ndarray:
    n, nseg = x.size, starts.size
    out = np.zeros((nseg, N_STATS), dtype=np.float64)
    # seg: the segments' layout, None for a single tensor (whole-array reductions)
    seg = None
    if nseg > 1:
        seg = _layout(starts, n, w, sc)
        sizes, spans = seg.sizes, seg.spans
    else:
        sizes = np.array([n])

    def per_seg(values, ufunc=np.add):
        return ufunc.reduceat(values, starts) if seg is not None else ufunc.reduce(values)[None]

    def above_of(v, tbits):
        # [nseg, len(tbits)]: values with v > tbits[j], as float64
        mask = sc.mask[:n]
        if seg is None:
            return np.array([[np.count_nonzero(np.greater(v, t, out=mask)) for t in tbits]],
                            dtype=np.float64)
        cls = sc.cls[:n]
        cls[:] = 0
        for t in tbits:
            np.greater(v, t, out=mask)
            np.add(cls, mask, out=cls, casting="unsafe")
        idx = sc.idx[:n]
        np.floor_divide(seg.ebase, np.int32(w.n_exp), out=idx)   # each value's segment
        np.multiply(idx, np.int32(tbits.size + 1), out=idx)
        np.add(idx, cls, out=idx)
        per = _bincount(idx, nseg * (tbits.size + 1)).reshape(nseg, -1)
        return np.cumsum(per[:, ::-1], axis=1)[:, ::-1][:, 1:].astype(np.float64)

    b = x.view(w.int)
    ab, tmp, mask, ex = sc.ab[:n], sc.tmp[:n], sc.mask[:n], sc.ex[:n]
    np.bitwise_and(b, w.int(w.mag), out=ab)   # |x| as bits

    # exponent field counts: the histogram, and most counts below without a pass of their own
    np.right_shift(ab, w.exp_shift, out=ex, casting="unsafe")
    if seg is None:
        ecount = _bincount(ex, w.n_exp)
    else:
        idx = sc.idx[:n]
        np.add(seg.ebase, ex, out=idx, casting="unsafe")   # ex < n_exp
        ecount = _bincount(idx, nseg * w.n_exp)
    ecount = ecount.reshape(nseg, w.n_exp).astype(np.float64)
    # beyond[:, e]: values whose exponent field exceeds e
    beyond = np.zeros((nseg, w.n_exp), dtype=np.float64)
    beyond[:, :-1] = np.cumsum(ecount[:, :0:-1], axis=1)[:, ::-1]
    etotal = ecount.sum(axis=0) if nseg > 1 else ecount[0]   # values per exponent field

    def count(op, t):
        # [nseg]: values with op(|x| bits, t); one pass, a second only when some value counts
        hit = np.count_nonzero(op(ab, t, out=mask))
        if not hit or seg is None:
            return np.full(nseg, float(hit))
        if hit * 16 <= n:   # a few values: their segments, not a pass over all
            at = np.searchsorted(starts, np.flatnonzero(mask), "right") - 1
            return np.bincount(at, minlength=nseg).astype(np.float64)
        if nseg <= 32:   # count_nonzero of each segment's view: no cast of the whole mask
            return np.array([np.count_nonzero(mask[a: a + m]) for a, m in spans], np.float64)
        return np.add.reduceat(mask, starts, dtype=np.int64).astype(np.float64)

    narrow = ex.itemsize < ab.itemsize

    def above_x(tbits, plan):
        # above_of(ab, tbits) from the exponent counts: beyond T's exponent, plus the values of
        # T's own exponent above T. None are when T is its exponent's largest pattern; when T
        # is the smallest, all are but those equal to T (one equality pass, most often empty)
        e_t, bins, _ = plan
        res = beyond[:, e_t]
        for e, todo in bins:
            inside = etotal[e]
            if not inside:
                continue
            if inside * 16 <= n and (len(todo) > 1 or seg is not None or narrow):
                # few values of T's exponent: they alone answer for every T of it (one pass
                # over the exponents finds them), by segment without a pass of their own (one T
                # of one segment: its own comparison over |x| costs no more, unless the
                # exponents are narrower than |x|)
                np.equal(ex, e, out=mask)
                pos = np.flatnonzero(mask)
                v = ab[pos]
                at = None if seg is None else np.searchsorted(starts, pos, "right") - 1
                for j, tb, kind in todo:
                    hit = v == tb if kind == 1 else v > tb
                    got = (np.bincount(at[hit], minlength=nseg) if at is not None
                           else np.count_nonzero(hit))
                    if kind == 1:
                        res[:, j] += ecount[:, e] - got
                    else:
                        res[:, j] += got
                continue
            for j, tb, kind in todo:
                if kind == 1:
                    res[:, j] += ecount[:, e] - count(np.equal, tb)
                else:
                    res[:, j] = count(np.greater, tb)
        return res

    # counts: comparisons of bit patterns. Zeros lie below every threshold and non-finite x
    # above every one (|x * s| is NaN or Inf), so both come back out by their counts.
    th = _thresholds(w)
    if scale == 1.0:
        above = above_x(th.both, th.plan_both)
        ax, af = above[:, th.x_at], above[:, th.fmt_at]
    else:
        y = sc.d[:n].view(w.float)[:n] if w is _F32 else sc.sq[:n]
        np.multiply(x, w.float(scale), out=y)
        np.abs(y, out=y)
        ax, af = above_x(th.x, th.plan_x), above_of(y.view(w.int), th.fmt)
    if ax[:, 1].any():
        posinf = -np.diff(above_of(b, np.array([w.inf - 1, w.inf], dtype=w.int)), axis=1)[:, 0]
    else:
        posinf = np.zeros(nseg)
    zeros, nonfinite, fnz_all = _fill_counts(out, ax, af, posinf, ecount, sizes, scale, th, w)
    out[:, Stat.ABSMIN_NZ] = _absmin_nz(ab, ex, ecount, zeros, per_seg, seg is None, w, sc)

    clean = not nonfinite.any()
    if clean:
        mn, mx = per_seg(x, np.minimum), per_seg(x, np.maximum)
    else:
        np.less(ab, w.inf, out=mask)    # finite
        mn = per_seg(np.where(mask, x, np.inf), np.minimum)
        mx = per_seg(np.where(mask, x, -np.inf), np.maximum)
    out[:, Stat.MIN], out[:, Stat.MAX] = mn, mx
    out[:, Stat.ABSMAX] = np.maximum(-mn.astype(np.float64), mx)

    d, sq = sc.d[:n], sc.sq[:n]
    if w is _F64 and clean:
        src = x   # float64 with nothing to zero: the sums read x where it is
    else:
        src = d
        np.copyto(d, x)
        if not clean:
            np.copyto(d, 0.0, where=~mask)
    if seg is None:
        out[0, Stat.SUM], out[0, Stat.SUMSQ] = np.add.reduce(src), dots(src)[1]
        np.subtract(src, k[0], out=d)
        if not clean:
            np.copyto(d, 0.0, where=~mask)
        out[0, Stat.SHIFT_SUMSQ] = dots(d)[1]
    elif nseg <= FEW_SEGMENTS:
        # each of a few segments as the single one above: its dots read its values where they
        # are, where products and segment sums write and read whole float64 arrays (for many
        # segments, the calls per segment cost more than those passes)
        sums = out[:, Stat.SUM: Stat.SUMSQ + 1]
        for i, ((a, m), ki) in enumerate(zip(spans, k.tolist())):   # sync-ok: numpy
            part = d[a: a + m]
            sums[i] = np.add.reduce(src[a: a + m]), dots(src[a: a + m])[1]
            np.subtract(src[a: a + m], ki, out=part)
            if not clean:
                np.copyto(part, 0.0, where=~mask[a: a + m])
            out[i, Stat.SHIFT_SUMSQ] = dots(part)[1]
    else:
        np.multiply(src, src, out=sq)
        out[:, Stat.SUM], out[:, Stat.SUMSQ] = per_seg(src), per_seg(sq)
        np.subtract(src, np.repeat(k, sizes), out=d)
        if not clean:
            np.copyto(d, 0.0, where=~mask)
        np.multiply(d, d, out=sq)
        out[:, Stat.SHIFT_SUMSQ] = per_seg(sq)
    out[:, Stat.SHIFT] = k
    # the shifted sum as the kernels take it, SUM - n K (its square sum needs its own pass)
    out[:, Stat.SHIFT_SUM] = out[:, Stat.SUM] - fnz_all * k

    # fingerprint: the low and high 16 bits of each (32-bit, NaN canonical) pattern, summed in
    # float64 (exact: each term is below 2^16)
    if w is _F64:   # the XOR of each pattern's two 32-bit halves (their order does not matter)
        halves32 = b.view(np.uint32)
        u = sc.folded[:n]
        np.bitwise_xor(halves32[0::2], halves32[1::2], out=u)
    else:
        u = b.view(np.uint32)
    if out[:, Stat.NAN].any():
        u = np.where(ab > w.inf, np.uint32(0x7FC00000), u)
    if seg is None:   # n <= CHUNK = 2^17 values: what halves takes
        out[:, Stat.BITS_LO], out[:, Stat.BITS_HI] = halves(u, sc.words)
        return out
    t = tmp.view(np.uint32)[:n]
    np.bitwise_and(u, np.uint32(0xFFFF), out=t)
    # integer sums, exact: a segment of at most 2^16 terms below 2^16 each sums below 2^32,
    # which the work's unsigned type holds without a cast; longer ones sum in uint64
    acc = np.uint32 if int(sizes.max()) <= 1 << 16 else np.uint64
    out[:, Stat.BITS_LO] = np.add.reduceat(t, starts, dtype=acc)
    np.right_shift(u, np.uint32(16), out=t)
    out[:, Stat.BITS_HI] = np.add.reduceat(t, starts, dtype=acc)
    return out


def _fill_counts(out, ax, af, posinf, ecount, sizes, scale: float, th, w: _Work) -> tuple:
    """The counts and the histogram of rows `out` from the tallies: ax [nseg, 3] values whose
    |x| bits exceed 0, the largest finite and inf; af [nseg, len(th.fmt)] those whose |x * scale|
    bits exceed each format threshold; ecount [nseg, n_exp] values per exponent field (all
    float64). Returns (zeros, nonfinite, finite) per segment."""
    nonzero, nonfinite, nan = ax[:, 0], ax[:, 1], ax[:, 2]
    zeros = sizes - nonzero
    out[:, Stat.NUMEL] = sizes
    out[:, Stat.NAN] = nan
    out[:, Stat.POSINF] = posinf
    out[:, Stat.NEGINF] = nonfinite - nan - posinf
    out[:, Stat.ZEROS] = zeros
    # af[:, j] over finite nonzero x only
    af = af - (nonfinite + (zeros if scale == math.inf else 0.0))[:, None]
    fnz = nonzero - nonfinite
    fnz_all = sizes - nonfinite          # finite values, zeros included
    j_max, j_under, j_normal = th.cols[:, 0], th.cols[:, 1], th.cols[:, 2]
    out[:, th.bases] = af[:, j_max]
    out[:, th.bases + 1] = fnz[:, None] - af[:, j_under]
    out[:, th.bases + 2] = af[:, j_under] - af[:, j_normal]

    lo = w.exp_bias + HIST_EMIN            # exponent field of the first bin
    hist = out[:, Stat.HIST: Stat.HIST + HIST_BINS]
    hist[:] = ecount[:, lo: lo + HIST_BINS]
    hist[:, 0] = ecount[:, : lo + 1].sum(axis=1) - zeros
    hist[:, -1] = ecount[:, lo + HIST_BINS - 1:].sum(axis=1) - nonfinite
    return zeros, nonfinite, fnz_all


def _absmin_nz(ab, ex, ecount, zeros, per_seg, single: bool, w: _Work, sc: _Scratch):
    """[nseg] smallest nonzero finite |x| of each segment."""
    n = ab.size
    if single:
        # one tensor: its smallest nonzero finite values lie in its lowest exponent field that
        # holds any (field 0 also holds the zeros; the last, Inf and NaN). When that field is
        # sparse, one pass over the exponents finds them.
        held = ecount[0, :-1].copy()
        held[0] -= zeros[0]
        fields = np.flatnonzero(held)
        if not fields.size:
            return np.full(1, np.inf)
        e = int(fields[0])
        if held[e] * 16 <= n:
            v = ab[np.flatnonzero(np.equal(ex, e, out=sc.mask[:n]))]
            if e == 0:
                v = v[v > 0]
            return np.array([v.min()], dtype=w.int).view(w.float).astype(np.float64)
    # zeros wrap to the largest unsigned pattern, Inf/NaN lie above every finite pattern
    tmp = sc.tmp[:n]
    np.subtract(ab, 1, out=tmp)
    m = per_seg(tmp.view(w.uint), np.minimum).astype(w.int) + 1
    return np.where((m > 0) & (m < w.inf), m, w.inf).view(w.float)


def _shift(first: np.ndarray) -> np.ndarray:
    # the reference's shift: the first element, 0 when it is not finite or zero (never -0.0)
    k = first.astype(np.float64)
    return np.where(np.isfinite(k) & (k != 0), k, 0.0)


def supported(t: torch.Tensor) -> bool:
    """True when cpu_row takes t: a CPU tensor of a statistics dtype."""
    return t.device.type == "cpu" and t.dtype in SUPPORTED_DTYPES and t.layout == torch.strided


def host_scale(scale) -> "float | None":
    """The sane value of a scale (stats/scale.py), None for a tensor off the CPU (reading it
    would wait for its device)."""
    if isinstance(scale, torch.Tensor):
        if scale.device.type != "cpu":
            return None
        scale = float(host_view(scale.detach().reshape(1).to(torch.float32))[0])
    return effective_scale(scale)


def cpu_row(t: torch.Tensor, scale: "float | torch.Tensor" = 1.0) -> np.ndarray:
    """The float64 statistics row of a CPU tensor (numpy), the reference's numbers."""
    if not supported(t):
        raise TypeError(f"stabilitywatch: no CPU statistics for a {t.dtype} tensor on {t.device}")
    s = host_scale(scale)
    if s is None:
        raise ValueError("stabilitywatch: a tensor-valued scale for a CPU tensor must be on the CPU")
    if t.numel() == 0:
        return init_row()
    return cpu_rows([t], [s])[0]


def cpu_rows(ts: list, scales: list) -> np.ndarray:
    """Rows of CPU tensors (each nonempty, supported) at host scales ([len(ts), N_STATS]): the
    small tensors of one dtype and scale share passes, a large one goes chunk by chunk."""
    with np.errstate(all="ignore"):   # NaN and Inf are data here, not mistakes
        return _cpu_rows(ts, scales)


def _cpu_rows(ts: list, scales: list) -> np.ndarray:
    out = np.empty((len(ts), N_STATS), dtype=np.float64)
    groups: dict = {}
    for i, (t, s) in enumerate(zip(ts, scales)):
        if t.numel() <= SMALL:
            groups.setdefault((t.dtype, s), []).append(i)
        else:
            out[i] = _large(t, s)
    for (dtype, s), idx in groups.items():
        w = _work_of(dtype)
        sc = _scratch(w)
        batch: list[int] = []
        total = 0
        for i in idx + [None]:
            if i is not None and total + ts[i].numel() <= CHUNK:
                batch.append(i)
                total += ts[i].numel()
                continue
            if batch:
                x = _load([ts[j] for j in batch], w, sc)
                starts = np.cumsum([0] + [ts[j].numel() for j in batch[:-1]], dtype=np.int64)
                out[batch] = _rows(x, starts, _shift(x[starts]), s, w, sc)
            batch, total = ([i], ts[i].numel()) if i is not None else ([], 0)
    return out


def _large(t: torch.Tensor, scale: float) -> np.ndarray:
    w = _work_of(t.dtype)
    sc = _scratch(w)
    if t.numel() <= CHUNK:
        x = _load([t], w, sc)
        return _rows(x, np.zeros(1, dtype=np.int64), _shift(x[:1]), scale, w, sc)[0]
    flat = t.detach().resolve_neg().reshape(-1)
    k = _shift(_load([flat[:1]], w, sc))
    zero = np.zeros(1, dtype=np.int64)
    parts = [_rows(_load([flat[i: i + CHUNK]], w, sc), zero, k, scale, w, sc)[0]
             for i in range(0, flat.numel(), CHUNK)]
    return merge_rows(np.stack(parts))
