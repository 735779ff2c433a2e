"""What one rank puts into the reductions of a flush, and what the reduced tensors mean.

A flush covers a window of `slots` step ends (the same window on every rank: it is decided
from step-end counts). Rows and sentinel gradients are placed by an agreed table of keys
(`Tables`: the same index for a (module, role) on every rank, whatever order each rank touched
them in), so every rank's tensors have the same shape and merge with one all-reduce each:

- the MAX tensor (`pack_max`): per (slot, row) presence and the ids of the ranks that hold the
  row (MAX of the rank, MAX of minus the rank: the lowest and the highest), the kind, the step,
  the phase and position (MAX of their negation: the earliest), the scale, the shift the sums
  merge at (the shift of the lowest rank that has one, found in round 1: only that rank sends
  it), the ids of the ranks whose row holds NaN/Inf, a 52-bit digest of a replicated row's
  exact fingerprint fields (and minus it), then minus the MIN-merged statistics and the
  MAX-merged ones;
- the SUM tensor (`pack_sum`, after the MAX one: its shifted sums are re-expressed at the
  agreed shift first): the SUM-merged statistics and shifted sums of local and sharded rows
  (sharded ones only from the rank that owns the shard, unless nobody does), the number of
  ranks with NaN/Inf, and the number and sum of the ids of the ranks that hold the largest
  |x| (one rank there: it is named);
- a gradient's sentinel the same way (`pack_sentinel_max`, `pack_sentinel_sum`), only for the
  step ends where some rank's sentinel tripped.

Sizes depend on the table and the window only: the payload per rank does not grow with the
world size. Identity elements: -inf for MAX, 0 for SUM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..stats.layout import (_MAX_IDX, _MIN_IDX, _SHIFTED, _SUM_IDX, UNSET_SHIFT, Stat, reshift,
                            shift_is_set)
from ..stats.sentinel import C_ABSMAX, C_NAN, C_NONFINITE, C_SUMSQ
from . import wire
from .wire import OWNER, REPLICATED, SHARDED

NEG = -np.inf
_BAD = [int(Stat.NAN), int(Stat.POSINF), int(Stat.NEGINF)]
_MIN, _MAX, _SUM = np.array(_MIN_IDX), np.array(_MAX_IDX), np.array(_SUM_IDX)
# the exact fields of a fingerprint (counts, extremes, bit sums): equal digests, equal tensors
_DIGEST = [int(s) for s in (Stat.NUMEL, Stat.NAN, Stat.POSINF, Stat.NEGINF, Stat.ZEROS,
                            Stat.MIN, Stat.MAX, Stat.ABSMAX, Stat.ABSMIN_NZ, Stat.BITS_HI,
                            Stat.BITS_LO)]

# MAX tensor columns per row
A_HI, A_NLO, A_USE, A_STEP, A_NPHASE, A_NSEQ, A_SCALE, A_KIND, A_SHIFT, A_BHI, A_NBLO, A_DIG, \
    A_NDIG = range(13)
A_NMIN = 13
A_MAX = A_NMIN + len(_MIN_IDX)
WA = A_MAX + len(_MAX_IDX)
_A_ABSMAX = A_MAX + _MAX_IDX.index(int(Stat.ABSMAX))
# SUM tensor columns per row
B_SUM = 0
B_SHIFTED = len(_SUM_IDX)
B_BAD, B_NAT, B_RAT = B_SHIFTED + 2, B_SHIFTED + 3, B_SHIFTED + 4
WB = B_SHIFTED + 5
# sentinel columns: MAX, then SUM
SA_HI, SA_BHI, SA_NBLO, SA_ABSMAX, SA_NONFINITE, SA_NAN, SA_SUMSQ, SA_NUMEL = range(8)
WSA = 8
SB_NONFINITE, SB_NAN, SB_SUMSQ, SB_NUMEL, SB_BAD = range(5)
WSB = 5
# header of the first reduction (MAX): key agreement, a rank that closes, a rank that goes on
H_NEW, H_DIG, H_NDIG, H_NNEW, H_BLOB, H_FINAL, H_LIVE = range(7)
N_HEAD = 7


def digest(rows: np.ndarray) -> np.ndarray:
    """52-bit digests (exact in float64) of the rows' exact fingerprint fields."""
    v = np.ascontiguousarray(rows[:, _DIGEST], dtype=np.float64) + 0.0   # -0.0 as 0.0
    bits = v.view(np.uint64)
    h = np.full(len(rows), 0xCBF29CE484222325, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in range(bits.shape[1]):
            h = (h ^ bits[:, c]) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    return (h & np.uint64((1 << 52) - 1)).astype(np.float64)


def key_digest(keys) -> float:
    """A digest of a set of table keys (52 bits, exact in float64); 0 for none."""
    if not keys:
        return 0.0
    a = np.array(sorted(keys), dtype=np.uint64)
    h = np.uint64(0x84222325CBF29CE4)
    with np.errstate(over="ignore"):
        for x in a:
            h = (h ^ x) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(31)
    return float(int(h) & ((1 << 52) - 1)) or 1.0


@dataclass
class Tables:
    """The agreed keys: rows (statistics) and sentinel rows (gradients), in the same order on
    every rank; names of every key seen (here or in a gathered list of new keys)."""
    rows: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    row_index: dict = field(default_factory=dict)
    sent_index: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)    # ("r" | "s", key) -> (module, role)

    def add(self, section: str, keys) -> None:
        lst, idx = (self.rows, self.row_index) if section == "r" else (self.sent, self.sent_index)
        for k in sorted(set(keys) - set(idx)):
            idx[k] = len(lst)
            lst.append(k)

    def new_keys(self, lfs: list, rows_kinds) -> set:
        """(section, key) of this rank's rows in the window that the table lacks."""
        out = set()
        for lf in lfs:
            for k, kind, name in zip(lf.key_ids, lf.kinds, lf.frame.keys):
                if rows_kinds(kind) and k not in self.row_index:
                    out.add(("r", k))
                    self.names.setdefault(("r", k), name)
            for k, name in zip(sentinel_ids(lf), _sent_keys(lf)):
                if k not in self.sent_index:
                    out.add(("s", k))
                    self.names.setdefault(("s", k), name)
        return out


def _sent_keys(lf) -> list:
    s = lf.frame.sentinel
    return list(s.keys) if s is not None else []


def sentinel_ids(lf) -> list:
    return [wire.key_id(m, r) for m, r in _sent_keys(lf)]


def tripped(lf) -> bool:
    s = lf.frame.sentinel
    return s is not None and bool(np.any(np.asarray(s.nonfinite) > 0))


def _bad(rows: np.ndarray) -> np.ndarray:
    return rows[:, _BAD].sum(axis=1) > 0


# round 1's code of a row a rank holds: -2 x rank when its shift is set (MAX: the lowest rank
# with a shift, whose shift the merged row takes, as the all-gather merge does), else this
UNSET_CODE = -2.0 ** 60


def presence(lfs_by_slot: list, tables: Tables, rank: int, rows_kinds) -> np.ndarray:
    """[slots, rows] round-1 codes: -inf where this rank lacks the row."""
    out = np.full((len(lfs_by_slot), len(tables.rows)), NEG)
    for s, lf in enumerate(lfs_by_slot):
        if lf is None:
            continue
        keep = [i for i, kind in enumerate(lf.kinds) if rows_kinds(kind)]
        if keep:
            j = np.array([tables.row_index[lf.key_ids[i]] for i in keep])
            k = np.asarray(lf.frame.rows, dtype=np.float64)[keep, Stat.SHIFT]
            out[s, j] = np.where(shift_is_set(k), -2.0 * rank, UNSET_CODE)
    return out


def lowest_with_shift(codes: np.ndarray) -> np.ndarray:
    """The reduced round-1 codes as the lowest rank with a set shift (-1: none)."""
    return np.where(codes > UNSET_CODE, -codes / 2.0, -1.0)


def _selected(lf, tables: Tables, rows_kinds):
    """The rows of one LocalFrame that this reduction carries: (their indexes in the frame,
    their rows in the table, the rows, their kinds), or None when there are none (or no frame)."""
    if lf is None:
        return None
    keep = [i for i, kind in enumerate(lf.kinds) if rows_kinds(kind)]
    if not keep:
        return None
    j = np.array([tables.row_index[lf.key_ids[i]] for i in keep])
    rows = np.asarray(lf.frame.rows, dtype=np.float64)[keep]
    return keep, j, rows, np.array([lf.kinds[i] for i in keep], dtype=np.int64)


def pack_max(lfs_by_slot: list, tables: Tables, rank: int, rows_kinds,
             lowest: np.ndarray) -> np.ndarray:
    """[slots, rows, WA] for the given slots (a LocalFrame or None each); `lowest`: the rank
    whose shift each row takes (lowest_with_shift)."""
    out = np.full((len(lfs_by_slot), len(tables.rows), WA), NEG)
    for s, lf in enumerate(lfs_by_slot):
        sel = _selected(lf, tables, rows_kinds)
        if sel is None:
            continue
        keep, j, rows, kinds = sel
        kind = kinds & 3
        o = out[s]
        o[j, A_HI] = rank
        o[j, A_NLO] = -rank
        o[j, A_USE] = ((kind != SHARDED) | ((kinds & OWNER) != 0)).astype(np.float64)
        o[j, A_STEP] = lf.frame.step
        o[j, A_NPHASE] = -np.asarray(lf.frame.phases, dtype=np.float64)[keep]
        o[j, A_NSEQ] = -np.asarray(lf.seqs, dtype=np.float64)[keep]
        o[j, A_SCALE] = np.asarray(lf.frame.scales, dtype=np.float64)[keep]
        o[j, A_KIND] = kind
        k = rows[:, Stat.SHIFT]
        o[j, A_SHIFT] = np.where(shift_is_set(k) & (lowest[s, j] == rank), k, NEG)
        bad = _bad(rows)
        o[j, A_BHI] = np.where(bad, rank, NEG)
        o[j, A_NBLO] = np.where(bad, -rank, NEG)
        rep = kind == REPLICATED
        d = digest(rows)
        o[j, A_DIG] = np.where(rep, d, NEG)
        o[j, A_NDIG] = np.where(rep, -d, NEG)
        o[j, A_NMIN:A_MAX] = -rows[:, _MIN]
        o[j, A_MAX:WA] = rows[:, _MAX]
    return out


def shifts(amax: np.ndarray) -> np.ndarray:
    """The shift each merged row's sums are expressed at (unset where no rank set one)."""
    k = amax[..., A_SHIFT]
    return np.where(np.isfinite(k), k, UNSET_SHIFT)


def pack_sum(lfs_by_slot: list, tables: Tables, rank: int, rows_kinds,
             amax: np.ndarray) -> np.ndarray:
    """[slots, rows, WB]; `amax` the reduced MAX tensor of the same slots."""
    out = np.zeros((len(lfs_by_slot), len(tables.rows), WB))
    ks = shifts(amax)
    for s, lf in enumerate(lfs_by_slot):
        sel = _selected(lf, tables, rows_kinds)
        if sel is None:
            continue
        keep, j, rows, kinds = sel
        kind = kinds & 3
        owned = amax[s, j, A_USE] > 0
        use = (kind != REPLICATED) & (((kind != SHARDED) | ((kinds & OWNER) != 0)) | ~owned)
        o = out[s]
        o[j, B_BAD] = _bad(rows)
        if not use.any():
            continue
        ju, ru = j[use], reshift(rows[use], ks[s, j[use]])
        o[ju, B_SUM:B_SHIFTED] = ru[:, _SUM]
        o[ju, B_SHIFTED:B_SHIFTED + 2] = ru[:, _SHIFTED]
        at = (ru[:, Stat.ABSMAX] == amax[s, ju, _A_ABSMAX]) & np.isfinite(ru[:, Stat.ABSMAX])
        o[ju, B_NAT] = at
        o[ju, B_RAT] = np.where(at, rank, 0.0)
    return out


def pack_sentinel_max(lfs_by_slot: list, tables: Tables, rank: int) -> np.ndarray:
    out = np.full((len(lfs_by_slot), len(tables.sent), WSA), NEG)
    for s, lf in enumerate(lfs_by_slot):
        sent = lf.frame.sentinel if lf is not None else None
        if sent is None or not len(sent.keys):
            continue
        j = np.array([tables.sent_index[k] for k in sentinel_ids(lf)])
        bad = np.asarray(sent.nonfinite) > 0
        o = out[s]
        o[j, SA_HI] = rank
        o[j, SA_BHI] = np.where(bad, rank, NEG)
        o[j, SA_NBLO] = np.where(bad, -rank, NEG)
        o[j, SA_ABSMAX] = sent.absmax
        o[j, SA_NONFINITE] = sent.nonfinite
        o[j, SA_NAN] = sent.nan
        o[j, SA_SUMSQ] = sent.sumsq
        o[j, SA_NUMEL] = sent.numel
    return out


def pack_sentinel_sum(lfs_by_slot: list, tables: Tables) -> np.ndarray:
    out = np.zeros((len(lfs_by_slot), len(tables.sent), WSB))
    for s, lf in enumerate(lfs_by_slot):
        sent = lf.frame.sentinel if lf is not None else None
        if sent is None or not len(sent.keys):
            continue
        j = np.array([tables.sent_index[k] for k in sentinel_ids(lf)])
        o = out[s]
        o[j, SB_NONFINITE] = sent.nonfinite
        o[j, SB_NAN] = sent.nan
        o[j, SB_SUMSQ] = sent.sumsq
        o[j, SB_NUMEL] = sent.numel
        o[j, SB_BAD] = np.asarray(sent.nonfinite) > 0
    return out


def rank_range(hi: float, nlo: float, count: float):
    """(lo, hi, count) of the ranks a MAX/MIN pair names, or None when no rank did."""
    if not np.isfinite(hi):
        return None
    return int(-nlo), int(hi), int(round(count))


def listed(r) -> list:
    """The ranks of a range, listed when the range holds exactly them (and a few), else its
    ends."""
    lo, hi, n = r
    return list(range(lo, hi + 1)) if n == hi - lo + 1 and n <= 16 else [lo, hi]
