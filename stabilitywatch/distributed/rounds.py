"""One flush by reduction: the rounds every rank runs, in the same order, on the same shapes.

1. MAX of a small header and flags: key agreement (a rank with keys the table lacks), a rank
   that closes, per (step end, row) presence with the lowest rank whose row has a shift (its
   shift is the merged row's), and per step end whether a sentinel tripped. Only
   when some rank has new keys: their digests agree (every rank has the same new keys: each
   adds its own) or the new names are gathered once (all-gather, the only one, at the first
   flush of a new module), and round 1 runs again on the grown table.
2. MAX of the present rows' metadata and MIN/MAX statistics (and tripped step ends' sentinels).
3. SUM of their sums, re-expressed at the shift round 2 agreed on (dist.mode="rank0" only).
4. Only when a replicated row's digests differ (the MIN and MAX of the ranks' digests): MAX of
   the ids of the ranks at either extreme, then SUM of how many ranks sit at each extreme and of
   the two lowest such ranks' fingerprints (every other rank adds zeros): those ranks' details,
   gathered from them alone.
5. Only when a merged row holds NaN/Inf (rank0 mode): SUM of the lowest and highest bad
   rank's own counts (details.py).

`plan` yields the rounds one by one, so a driver may run them at once on a side group (`run`)
or queue each on the job's group and read it at the next step end (deferred.py).

Every decision to run a round is taken from reduced values, the same on every rank, so the
ranks stay in lockstep whatever they saw. An unsampled step end with finite gradients costs
round 1 alone: 8 bytes per table row and step end, plus 56.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..stats.layout import N_STATS, Stat, init_row
from . import details
from . import reduce as R
from .merge import DistFrame
from .wire import FP_INDEX, REPLICATED


@dataclass
class Reduced:
    """A flush's reduced tensors, as every rank sees them."""
    slots: int
    sel: np.ndarray                       # [slots, rows] bool: rows some rank holds
    trip: list                            # step-end slots where a sentinel tripped
    amax: Optional[np.ndarray] = None     # [n_sel, WA]
    bsum: Optional[np.ndarray] = None     # [n_sel, WB]
    smax: Optional[np.ndarray] = None     # [len(trip), n_sent, WSA]
    ssum: Optional[np.ndarray] = None     # [len(trip), n_sent, WSB]
    groups: dict = field(default_factory=dict)   # (slot, row) -> [(rank, fp, n, lo, hi)], n
    others_final: bool = False
    stopped: bool = False                 # round 1 found closing and live ranks (stop_mixed)
    details: dict = field(default_factory=dict)        # n -> the named bad ranks' counts
    sent_details: dict = field(default_factory=dict)   # (trip index, sent row) -> the same


def _blob(tables: R.Tables, new: set) -> bytes:
    items = [[s, k, *tables.names[(s, k)]] for s, k in sorted(new)]
    return json.dumps(items, separators=(",", ":")).encode() if items else b""


def _agree(tables, new, head):
    if head[R.H_NNEW] == -1 and head[R.H_DIG] == -head[R.H_NDIG]:
        got = new              # every rank has new keys, and the same ones
    else:
        blob = _blob(tables, new)
        buf = np.zeros(max(int(head[R.H_BLOB]), 1), dtype=np.uint8)
        buf[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        got = set()
        for b in (yield ("gather", buf)):
            text = bytes(b).rstrip(b"\0")
            for s, k, m, r in (json.loads(text.decode()) if text else []):
                got.add((s, int(k)))
                tables.names.setdefault((s, int(k)), (str(m), str(r)))
    tables.add("r", [k for s, k in got if s == "r"])
    tables.add("s", [k for s, k in got if s == "s"])


def run(window: list, tables: R.Tables, comm, rank: int, full: bool, compare: bool,
        final: bool) -> Reduced:
    """window: this rank's LocalFrame (or None) per step-end slot of the flush; each collective
    run on `comm` as it comes."""
    return drive(plan(window, tables, rank, full, compare, final), comm)


def drive(gen, comm):
    """Run a plan's collectives one after another on `comm`; the plan's result."""
    try:
        req = next(gen)
        while True:
            kind, a = req
            req = gen.send(comm.all_gather(a) if kind == "gather" else comm.all_reduce(a, kind))
    except StopIteration as stop:
        return stop.value


def plan(window: list, tables: R.Tables, rank: int, full: bool, compare: bool, final: bool,
         stop_mixed: bool = False):
    """The rounds of one flush as a generator: it yields each collective as (op, array), op one
    of "max", "sum", "gather", and is sent its result; it returns the Reduced. A driver runs the
    collectives at once (`drive`) or queues each and sends its result later (deferred.py)."""
    kinds_in = (lambda k: True) if full else (lambda k: k & 3 == REPLICATED)
    lfs = [lf for lf in window if lf is not None]
    new = tables.new_keys(lfs, kinds_in) if full else \
        {x for x in tables.new_keys(lfs, kinds_in) if x[0] == "r"}
    trip_local = [float(full and lf is not None and R.tripped(lf)) for lf in window]
    while True:
        n_rows, n_sent = len(tables.rows), len(tables.sent)
        has = float(bool(new))
        dig = R.key_digest([k | (1 << 52 if s == "s" else 0) for s, k in new]) if new else 0.0
        head = np.array([has, dig, -dig, -has, len(_blob(tables, new)) if new else 0,
                         float(final), float(not final)])
        pres = R.presence(window, tables, rank, kinds_in) if not new else \
            np.full((len(window), n_rows), R.NEG)
        out = yield ("max", np.concatenate([head, pres.ravel(), trip_local]))
        head = out[:R.N_HEAD]
        if head[R.H_NEW] > 0:
            yield from _agree(tables, new, head)
            new = set()
        elif (len(tables.rows), len(tables.sent)) == (n_rows, n_sent):
            break
        # else a flush still in flight (deferred.py) grew the table while this round ran: the
        # same on every rank, so every rank runs the round again on the grown table
    # the table as round 1 saw it: a flush in flight may grow the live one under the later
    # rounds (deferred.py); this window's keys all sit in it (no rank had new ones)
    tables = R.Tables(rows=list(tables.rows), sent=list(tables.sent),
                      row_index=tables.row_index, sent_index=tables.sent_index,
                      names=tables.names)
    codes = out[R.N_HEAD:R.N_HEAD + pres.size].reshape(pres.shape)
    sel = codes > R.NEG
    trip = [s for s, v in enumerate(out[R.N_HEAD + pres.size:]) if v > 0]
    red = Reduced(slots=len(window), sel=sel, trip=trip,
                  others_final=head[R.H_FINAL] > 0 and not final)
    if stop_mixed and head[R.H_FINAL] > 0 and head[R.H_LIVE] > 0:
        # some ranks close, others go on: the flushes still in flight cannot all be finished
        # in step (deferred.py), so every rank stops here and reads its own frames
        red.stopped = True
        return red
    if not sel.any() and not trip:
        return red
    a_loc = R.pack_max(window, tables, rank, kinds_in, R.lowest_with_shift(codes))
    t_win = [window[s] for s in trip]
    s_loc = R.pack_sentinel_max(t_win, tables, rank)
    n_sel = int(sel.sum())
    got = yield ("max", np.concatenate([a_loc[sel].ravel(), s_loc.ravel()]))
    red.amax = got[:n_sel * R.WA].reshape(n_sel, R.WA)
    red.smax = got[n_sel * R.WA:].reshape(s_loc.shape)
    if full:
        amax_dense = np.full(a_loc.shape, R.NEG)
        amax_dense[sel] = red.amax
        b_loc = R.pack_sum(window, tables, rank, kinds_in, amax_dense)
        s_sum = R.pack_sentinel_sum(t_win, tables)
        got = yield ("sum", np.concatenate([b_loc[sel].ravel(), s_sum.ravel()]))
        red.bsum = got[:n_sel * R.WB].reshape(n_sel, R.WB)
        red.ssum = got[n_sel * R.WB:].reshape(s_sum.shape)
        if details.needed(red):   # a bad row: its named ranks' own counts, from them alone
            details.unpack(red, (yield ("sum", details.pack(red, window, tables, rank))))
    if compare:
        yield from _divergence(red, window, tables, rank, a_loc[sel])
    return red


def _divergence(red: Reduced, window, tables, rank, a_own: np.ndarray):
    a = red.amax
    div = np.flatnonzero((a[:, R.A_KIND] == REPLICATED) & np.isfinite(a[:, R.A_DIG])
                         & (a[:, R.A_DIG] != -a[:, R.A_NDIG]))
    if not len(div):
        return
    pos = np.argwhere(red.sel)                       # (slot, row) of each selected entry
    lo_d, hi_d = -a[div, R.A_NDIG], a[div, R.A_DIG]
    mine = a_own[div, R.A_DIG]
    here = np.isfinite(mine)
    at_lo, at_hi = here & (mine == lo_d), here & (mine == hi_d)
    ids = np.full((len(div), 4), R.NEG)
    ids[at_lo, 0], ids[at_lo, 1] = rank, -rank
    ids[at_hi, 2], ids[at_hi, 3] = rank, -rank
    ids = (yield ("max", ids.ravel())).reshape(len(div), 4)
    nf = len(FP_INDEX)
    part = np.zeros((len(div), 3 + 2 * nf))
    part[:, 0], part[:, 1], part[:, 2] = at_lo, at_hi, here
    for d, (s, j) in enumerate(pos[div]):
        lf = window[s]
        if lf is None or not here[d]:
            continue
        i = lf.key_ids.index(tables.rows[j])
        fp = np.asarray(lf.frame.rows[i], dtype=np.float64)[FP_INDEX]
        if at_lo[d] and rank == int(-ids[d, 1]):
            part[d, 3:3 + nf] = fp
        if at_hi[d] and rank == int(-ids[d, 3]):
            part[d, 3 + nf:] = fp
    part = (yield ("sum", part.ravel())).reshape(len(div), 3 + 2 * nf)
    for d, (s, j) in enumerate(pos[div]):
        n_lo, n_hi, n = part[d, :3]
        grp = [(int(-ids[d, 1]), part[d, 3:3 + nf], int(n_lo), int(-ids[d, 1]), int(ids[d, 0])),
               (int(-ids[d, 3]), part[d, 3 + nf:], int(n_hi), int(-ids[d, 3]), int(ids[d, 2]))]
        red.groups[(int(s), int(j))] = (grp, int(n))


# -- frames ------------------------------------------------------------------------------------
def _merged_row(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    row = init_row()
    row[R._MIN] = -a[R.A_NMIN:R.A_MAX]
    row[R._MAX] = a[R.A_MAX:R.WA]
    row[R._SUM] = b[R.B_SUM:R.B_SHIFTED]
    row[[int(Stat.SHIFT_SUM), int(Stat.SHIFT_SUMSQ)]] = b[R.B_SHIFTED:R.B_SHIFTED + 2]
    row[Stat.SHIFT] = R.shifts(a[None])[0]
    return row


def _attach_groups(f: DistFrame, i: int, got) -> None:
    grp, n = got
    f.replicas[i] = {r: fp for r, fp, _, _, _ in grp}
    f.replica_info[i] = {"present": n, **{r: (c, lo, hi) for r, _, c, lo, hi in grp}}


def merged(red: Reduced, window: list, tables: R.Tables, rank: int, world: int,
           sharded_grad: Callable[[tuple], bool]) -> list:
    """rank0 mode: the frames of the window merged across ranks (as merge.merged_frames)."""
    pos = np.argwhere(red.sel)
    by_slot: dict = {}
    for n, (s, j) in enumerate(pos):
        by_slot.setdefault(int(s), []).append((n, int(j)))
    frames = []
    for s, lf in enumerate(window):
        entries, info = [], {}
        for n, j in by_slot.get(s, []):
            a, b = red.amax[n], red.bsum[n]
            key = tables.rows[j]
            bad = R.rank_range(a[R.A_BHI], a[R.A_NBLO], b[R.B_BAD])
            if a[R.A_KIND] == REPLICATED:
                info[key] = (bad, red.groups.get((s, j)), red.details.get(n))
                continue
            name = tables.names.get(("r", key))
            if name is None:
                continue
            at = int(b[R.B_RAT]) if b[R.B_NAT] == 1 else None
            entries.append((-a[R.A_NPHASE], -a[R.A_NSEQ], key, name, _merged_row(a, b),
                            float(a[R.A_SCALE]), int(a[R.A_KIND]), None, bad, int(a[R.A_STEP]),
                            at, red.details.get(n)))
        if lf is not None:
            for i, (k, kind) in enumerate(zip(lf.key_ids, lf.kinds)):
                if kind & 3 == REPLICATED:
                    bad, got, det = info.get(k, (None, None, None))
                    entries.append((lf.frame.phases[i], lf.seqs[i], k, lf.frame.keys[i],
                                    lf.frame.rows[i], lf.frame.scales[i], REPLICATED, got, bad,
                                    lf.frame.step, None, det))
        tripped = s in red.trip
        if not entries and not tripped:
            continue
        entries.sort(key=lambda x: (x[0], x[1], x[2]))
        step = lf.frame.step if lf is not None else max(x[9] for x in entries)
        f = DistFrame(step=step, keys=[x[3] for x in entries],
                      rows=np.stack([x[4] for x in entries]).reshape(-1, N_STATS)
                      if entries else np.zeros((0, N_STATS)),
                      scales=[x[5] for x in entries], phases=[int(x[0]) for x in entries],
                      rank=rank, world_size=world, merged=True,
                      kinds=[x[6] for x in entries])
        for i, x in enumerate(entries):
            if x[7] is not None:
                _attach_groups(f, i, x[7])
            if x[8] is not None:
                f.bad_ranks[i] = R.listed(x[8])
                f.bad_range[i] = x[8]
            if x[11] is not None:
                f.bad_detail[i] = x[11]
            if x[10] is not None:
                f.absmax_rank[i] = x[10]
        if lf is not None and lf.frame.sentinel is not None:
            f.sentinel = lf.frame.sentinel
            if tripped:
                _merge_sentinel(f, red, red.trip.index(s), lf, tables, sharded_grad)
        frames.append(f)
    return frames


def _merge_sentinel(f, red, t, lf, tables, sharded_grad) -> None:
    import dataclasses
    sent = lf.frame.sentinel
    j = [tables.sent_index[k] for k in R.sentinel_ids(lf)]
    a, b = red.smax[t][j], red.ssum[t][j]
    sh = np.array([bool(sharded_grad(k)) for k in sent.keys])

    def pick(ca, cb):
        return np.where(sh, b[:, cb], a[:, ca]) if len(j) else np.zeros(0)
    f.sentinel = dataclasses.replace(
        sent, nonfinite=pick(R.SA_NONFINITE, R.SB_NONFINITE), nan=pick(R.SA_NAN, R.SB_NAN),
        sumsq=pick(R.SA_SUMSQ, R.SB_SUMSQ),
        numel=pick(R.SA_NUMEL, R.SB_NUMEL).astype(np.int64),
        absmax=np.where(np.isfinite(a[:, R.SA_ABSMAX]), a[:, R.SA_ABSMAX], 0.0))
    f.sentinel.skipped = sent.skipped
    for i, key in enumerate(sent.keys):
        r = R.rank_range(a[i, R.SA_BHI], a[i, R.SA_NBLO], b[i, R.SB_BAD])
        if r is not None:
            f.sentinel_bad[tuple(key)] = r
            det = red.sent_details.get((t, j[i]))
            if det is not None:
                f.sentinel_detail[tuple(key)] = det


def local(red: Reduced, window: list, tables: R.Tables, rank: int, world: int) -> list:
    """per_rank mode: this rank's own frames, replicas attached where the digests differ."""
    pos = np.argwhere(red.sel)
    groups = {(s, tables.rows[j]): red.groups[(int(s), int(j))]
              for s, j in pos if (int(s), int(j)) in red.groups}
    out = []
    for s, lf in enumerate(window):
        if lf is None:
            continue
        fr = lf.frame
        f = DistFrame(step=fr.step, keys=list(fr.keys), rows=fr.rows, scales=list(fr.scales),
                      phases=list(fr.phases), rank=rank, world_size=world, merged=False,
                      kinds=[k & 3 for k in lf.kinds], sentinel=fr.sentinel)
        for i, (k, kind) in enumerate(zip(lf.key_ids, lf.kinds)):
            if np.sum(np.asarray(fr.rows[i])[R._BAD]) > 0:
                f.bad_ranks[i] = [rank]
            if kind & 3 == REPLICATED and (s, k) in groups:
                _attach_groups(f, i, groups[(s, k)])
        out.append(f)
    return out
