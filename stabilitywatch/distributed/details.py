"""The per-rank details of a bad merged row, gathered from the ranks that the reduction named
and from them alone (a round of rounds.plan, run only when a merged row is bad).

After the MAX round every rank knows, for each merged row and each tripped sentinel row, the
lowest and the highest rank whose values hold NaN/Inf (the MAX of minus the rank and of the
rank). Only when some row has such ranks does one more all-reduce (SUM) run: the lowest and
the highest bad rank put their own counts into their half of the row's slot, every other rank
adds zeros, so the sum is exactly those ranks' values. Its size is O(bad rows); on a step
without NaN/Inf it does not run, so nothing per rank travels then.
"""
from __future__ import annotations

import numpy as np

from ..stats.layout import Stat
from . import reduce as R

# a bad row's details per named rank: its counts and its finite extremes
ROW_FIELDS = (Stat.NUMEL, Stat.NAN, Stat.POSINF, Stat.NEGINF, Stat.ABSMAX)
ROW_NAMES = ("numel", "nan", "posinf", "neginf", "absmax")
SENT_NAMES = ("numel", "nonfinite", "nan", "absmax")
_RF = [int(s) for s in ROW_FIELDS]


def _bad_rows(red) -> np.ndarray:
    a = red.amax
    return np.flatnonzero(np.isfinite(a[:, R.A_BHI])) if a is not None and len(a) else \
        np.zeros(0, dtype=np.int64)


def _bad_sent(red) -> np.ndarray:
    s = red.smax
    if s is None or not s.size:
        return np.zeros((0, 2), dtype=np.int64)
    return np.argwhere(np.isfinite(s[:, :, R.SA_BHI]))


def needed(red) -> bool:
    """From reduced values only: the same answer on every rank."""
    return bool(len(_bad_rows(red)) or len(_bad_sent(red)))


def pack(red, window: list, tables: R.Tables, rank: int) -> np.ndarray:
    rows, sent = _bad_rows(red), _bad_sent(red)
    nr, ns = len(_RF), len(SENT_NAMES)
    out_r = np.zeros((len(rows), 2, nr))
    out_s = np.zeros((len(sent), 2, ns))
    pos = np.argwhere(red.sel)
    a = red.amax
    for d, n in enumerate(rows):
        ends = (int(-a[n, R.A_NBLO]), int(a[n, R.A_BHI]))
        if rank not in ends:
            continue
        s, j = pos[n]
        lf = window[s]
        i = lf.key_ids.index(tables.rows[j])
        vals = np.asarray(lf.frame.rows[i], dtype=np.float64)[_RF]
        for half, r in enumerate(ends):
            if r == rank:
                out_r[d, half] = vals
    for d, (t, k) in enumerate(sent):
        sm = red.smax[t, k]
        ends = (int(-sm[R.SA_NBLO]), int(sm[R.SA_BHI]))
        if rank not in ends:
            continue
        lf = window[red.trip[t]]
        i = R.sentinel_ids(lf).index(tables.sent[k])
        sf = lf.frame.sentinel
        vals = np.array([sf.numel[i], sf.nonfinite[i], sf.nan[i], sf.absmax[i]], dtype=np.float64)
        for half, r in enumerate(ends):
            if r == rank:
                out_s[d, half] = vals
    return np.concatenate([out_r.ravel(), out_s.ravel()])


def unpack(red, got: np.ndarray) -> None:
    """red.details[n] and red.sent_details[(t, k)]: [{"rank": r, field: value, ...}] for the
    lowest and (when another) the highest bad rank."""
    rows, sent = _bad_rows(red), _bad_sent(red)
    nr, ns = len(_RF), len(SENT_NAMES)
    gr = got[:len(rows) * 2 * nr].reshape(len(rows), 2, nr)
    gs = got[len(rows) * 2 * nr:].reshape(len(sent), 2, ns)
    a = red.amax
    for d, n in enumerate(rows):
        red.details[int(n)] = _listed((int(-a[n, R.A_NBLO]), int(a[n, R.A_BHI])), gr[d],
                                      ROW_NAMES)
    for d, (t, k) in enumerate(sent):
        sm = red.smax[t, k]
        red.sent_details[(int(t), int(k))] = _listed(
            (int(-sm[R.SA_NBLO]), int(sm[R.SA_BHI])), gs[d], SENT_NAMES)


def _listed(ends: tuple, vals: np.ndarray, names: tuple) -> list:
    out = []
    for half, r in enumerate(ends):
        if half and r == ends[0]:
            break
        v = vals[half]
        out.append({"rank": r, **{nm: int(x) if nm != "absmax" else
                                  (float(x) if np.isfinite(x) else None)
                                  for nm, x in zip(names, v)}})
    return out
