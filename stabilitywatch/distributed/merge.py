"""Turning the payloads of one flush into frames (host side, numpy, no collectives).

`merged_frames` (dist.mode="rank0", on rank 0): one frame per step that any rank ended, its rows
merged across ranks by kind:
- LOCAL rows (activations, their gradients, the loss, the batch: different data on each rank)
  merge with `merge_rows` (sums add, min/max combine, histograms add): the statistics of the
  global batch;
- SHARDED rows (DTensor shards of parameters, gradients, optimizer state: FSDP2) merge the same
  way over the ranks that own a shard: the statistics of the unsharded tensor (the fingerprint
  bit sums are sums too, so they equal the full tensor's);
- REPLICATED rows (parameters, gradients after all-reduce, optimizer state under DDP) are the
  merging rank's own row; every rank's fingerprint rides along in `DistFrame.replicas` for the
  divergence detector.
`local_frames` (dist.mode="per_rank"): each rank's own frames with the replicas attached.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ..stats.buffer import StatsFrame
from ..stats.layout import (_MAX_IDX, _MIN_IDX, _SHIFTED, _SUM_IDX, N_STATS, UNSET_SHIFT, Stat,
                            init_row, reshift, shift_is_set)
from . import wire
from .wire import (M_END, M_FLAGS, M_KEY, M_PHASE, M_SCALE, M_SEQ, M_STEP, N_META, OWNER,
                   REPLICATED, SHARDED)

_BAD = [int(Stat.NAN), int(Stat.POSINF), int(Stat.NEGINF)]
_SUM, _MIN, _MAX = np.array(_SUM_IDX), np.array(_MIN_IDX), np.array(_MAX_IDX)
_FP_BAD = [wire.FP_STATS.index(s) for s in (Stat.NAN, Stat.POSINF, Stat.NEGINF)]
KIND_NAMES = {wire.LOCAL: "local", SHARDED: "sharded", REPLICATED: "replicated"}


@dataclass
class DistFrame(StatsFrame):
    """A StatsFrame of a distributed run. `merged`: rows combine every rank's (rank0 mode).
    `kinds[i]`: wire.LOCAL / SHARDED / REPLICATED. `replicas[i]`: {rank: fingerprint vector
    (wire.FP_STATS)} of a replicated row (by reduction: one rank of each extreme, only where
    the ranks differ). `bad_ranks[i]`: ranks whose row i holds NaN/Inf."""
    merged: bool = False
    kinds: list = field(default_factory=list)
    replicas: dict = field(default_factory=dict)
    bad_ranks: dict = field(default_factory=dict)
    # merged by reduction (distributed/rounds.py): ranks named by their extremes
    bad_range: dict = field(default_factory=dict)      # i -> (lo, hi, count) of bad_ranks
    absmax_rank: dict = field(default_factory=dict)    # i -> the one rank holding the max |x|
    replica_info: dict = field(default_factory=dict)   # i -> {"present": n, rank: (n, lo, hi)}
    sentinel_bad: dict = field(default_factory=dict)   # (module, role) -> (lo, hi, count)
    # the named bad ranks' own counts (distributed/details.py): [{"rank": r, "nan": ...}]
    bad_detail: dict = field(default_factory=dict)      # i -> of row i
    sentinel_detail: dict = field(default_factory=dict)  # (module, role) -> of its gradient


@dataclass
class LocalFrame:
    """One of this rank's frames, with what the flush needs to know about its rows."""
    end: int                 # index of the step end that produced it (the same on every rank)
    frame: StatsFrame
    key_ids: list
    kinds: list              # wire kind flags (with OWNER) per row
    seqs: list = field(default_factory=list)   # position among the rows of the same phase

    def __post_init__(self) -> None:
        if not self.seqs:
            count: dict[int, int] = {}
            for ph in self.frame.phases:
                self.seqs.append(count.get(ph, 0))
                count[ph] = count.get(ph, 0) + 1


def _fp_bad(fp: np.ndarray) -> bool:
    return bool(np.sum(fp[_FP_BAD]) > 0)


def merged_frames(payloads: list, names: dict, local: list, rank: int, world: int) -> list:
    """Frames merged across ranks, in step-end order (vectorised: one sort, three reduceats)."""
    mine = {lf.end: lf for lf in local}
    full = _stack([p.full for p in payloads], N_META + N_STATS)
    sender = np.concatenate([np.full(len(p.full), p.rank) for p in payloads]) if payloads \
        else np.zeros(0, dtype=np.int64)
    merged: dict[int, list] = {}     # end -> entries
    if len(full):
        order = np.lexsort((full[:, M_KEY], full[:, M_END]))
        full, sender = full[order], sender[order]
        ek = full[:, [M_END, M_KEY]]
        start = np.flatnonzero(np.r_[True, np.any(ek[1:] != ek[:-1], axis=1)])
        group = np.cumsum(np.r_[False, np.any(ek[1:] != ek[:-1], axis=1)])
        flags = full[:, M_FLAGS].astype(np.int64)
        use = ((flags & 3) != SHARDED) | ((flags & OWNER) != 0)
        owned = np.maximum.reduceat(use.astype(np.int8), start)
        use |= owned[group] == 0            # a sharded row nobody owns: take every shard
        stats = full[:, N_META:]
        out = np.tile(init_row(), (len(start), 1))
        if use.all():
            u_stats, u_start, u_group = stats, start, group
        else:   # drop unused rows (HSDP replicas); every group keeps at least one
            u_stats = stats[use]
            u_start = np.searchsorted(np.flatnonzero(use), start)
            u_group = group[use]
        # each group's shifted sums at one shift: its first row's that is set (layout.merge_rows)
        pos = np.where(shift_is_set(u_stats[:, Stat.SHIFT]), np.arange(len(u_stats)), len(u_stats))
        first = np.minimum.reduceat(pos, u_start)
        k = np.where(first < len(u_stats),
                     u_stats[np.minimum(first, len(u_stats) - 1), Stat.SHIFT], UNSET_SHIFT)
        u_stats = reshift(u_stats, k[u_group])
        out[:, _SHIFTED] = np.add.reduceat(u_stats[:, _SHIFTED], u_start, axis=0)
        out[:, Stat.SHIFT] = k
        out[:, _SUM] = np.add.reduceat(u_stats[:, _SUM], u_start, axis=0)
        out[:, _MIN] = np.minimum.reduceat(u_stats[:, _MIN], u_start, axis=0)
        out[:, _MAX] = np.maximum.reduceat(u_stats[:, _MAX], u_start, axis=0)
        phase = np.minimum.reduceat(full[:, M_PHASE], start)
        seq = np.minimum.reduceat(full[:, M_SEQ], start)
        bad_rows = np.flatnonzero(stats[:, _BAD].sum(axis=1) > 0)
        bad: dict[int, set] = {}
        for j in bad_rows:
            bad.setdefault(int(group[j]), set()).add(int(sender[j]))
        steps = np.minimum.reduceat(full[:, M_STEP], start)
        for g, j in enumerate(start):
            key = int(full[j, M_KEY])
            name = names.get(key)
            if name is None:
                continue    # its name never arrived (cannot happen unless a payload was lost)
            merged.setdefault(int(full[j, M_END]), []).append(
                (int(phase[g]), int(seq[g]), key, name, out[g], float(full[j, M_SCALE]),
                 int(flags[j]) & 3, None, sorted(bad.get(g, ())), int(steps[g])))
    fps: dict[tuple[int, int], dict] = {}
    for p in payloads:
        if len(p.fp):
            bad_fp = p.fp[:, [N_META + i for i in _FP_BAD]].sum(axis=1) > 0
            for r, b in zip(p.fp, bad_fp):
                fps.setdefault((int(r[M_END]), int(r[M_KEY])), {})[p.rank] = (r[N_META:], b)
    frames = []
    for end in sorted(set(merged) | set(mine)):
        entries, lf = merged.get(end, []), mine.get(end)
        if lf is not None:
            for i, (k, kind) in enumerate(zip(lf.key_ids, lf.kinds)):
                if kind & 3 != REPLICATED:
                    continue
                got = fps.get((end, k), {})
                reps = {rk: v for rk, (v, _) in got.items()}
                entries.append((lf.frame.phases[i], lf.seqs[i], k, lf.frame.keys[i],
                                lf.frame.rows[i], lf.frame.scales[i], REPLICATED, reps,
                                sorted(rk for rk, (_, b) in got.items() if b), lf.frame.step))
        if not entries:
            continue
        entries.sort(key=lambda x: (x[0], x[1], x[2]))
        step = lf.frame.step if lf is not None else min(x[9] for x in entries)
        f = DistFrame(step=step, keys=[x[3] for x in entries],
                      rows=np.stack([x[4] for x in entries]).reshape(-1, N_STATS),
                      scales=[x[5] for x in entries], phases=[x[0] for x in entries],
                      rank=rank, world_size=world, merged=True, kinds=[x[6] for x in entries])
        for i, x in enumerate(entries):
            if x[7] is not None:
                f.replicas[i] = x[7]
            if x[8]:
                f.bad_ranks[i] = x[8]
        frames.append(f)
    return frames


def _stack(parts: list, width: int) -> np.ndarray:
    parts = [p for p in parts if len(p)]
    return np.concatenate(parts) if parts else np.zeros((0, width))


def local_frames(payloads: list, local: list, rank: int, world: int) -> list:
    """This rank's own frames (dist.mode="per_rank"), with every rank's fingerprints of its
    replicated rows attached."""
    fps: dict[tuple[int, int], dict] = {}
    for p in payloads:
        for r in p.fp:
            fps.setdefault((int(r[M_END]), int(r[M_KEY])), {})[p.rank] = r[N_META:]
    out = []
    for lf in local:
        fr = lf.frame
        f = DistFrame(step=fr.step, keys=list(fr.keys), rows=fr.rows, scales=list(fr.scales),
                      phases=list(fr.phases), rank=rank, world_size=world, merged=False,
                      kinds=[k & 3 for k in lf.kinds])
        for i, (k, kind) in enumerate(zip(lf.key_ids, lf.kinds)):
            if np.sum(fr.rows[i][_BAD]) > 0:
                f.bad_ranks[i] = [rank]
            if kind & 3 == REPLICATED:
                reps = fps.get((lf.end, k))
                if reps:
                    f.replicas[i] = reps
        out.append(f)
    return out


def payload_rows(lf: LocalFrame, send_full: bool) -> tuple[np.ndarray, np.ndarray]:
    """(full rows, fingerprint rows) of one local frame for the wire: full rows of local and
    sharded rows when `send_full` (rank0 mode), fingerprint rows of replicated ones."""
    fr = lf.frame
    n = len(fr.keys)
    kinds = np.asarray(lf.kinds, dtype=np.int64).reshape(n)
    meta = np.column_stack([np.full(n, lf.end), np.full(n, fr.step),
                            np.asarray(lf.key_ids, dtype=np.float64).reshape(n),
                            np.asarray(fr.phases, dtype=np.float64).reshape(n),
                            np.asarray(lf.seqs, dtype=np.float64).reshape(n), kinds,
                            np.asarray(fr.scales, dtype=np.float64).reshape(n)]).astype(np.float64)
    rows = np.asarray(fr.rows, dtype=np.float64).reshape(n, N_STATS)
    rep = (kinds & 3) == REPLICATED
    fp = np.hstack([meta[rep], rows[rep][:, wire.FP_INDEX]])
    full = np.hstack([meta[~rep], rows[~rep]]) if send_full else np.zeros((0, N_META + N_STATS))
    return full, fp
