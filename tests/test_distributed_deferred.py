"""The deferred driver (distributed/deferred.py) in one process: each rank is a thread, every
collective is started at one "step end" and its result read at the next, flushes overlap (a
new one starts at every step end while older ones are in flight) and keys appear at several
flushes in a row, so a flush's table grows under it. Its merged frames equal those of the
same windows reduced one flush at a time (rounds.run)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from stabilitywatch.distributed import deferred, reduce, rounds
from stabilitywatch.stats.buffer import Phase
from test_distributed_reduce import LOC, SH, ThreadComm, _assert_same_frames, _lf, _row


class ThreadOps:
    """deferred.Ops between threads: a collective is handed in when started and meets the
    other ranks' when its result is read (every rank reads in the same order)."""

    def __init__(self, comm: ThreadComm):
        self.comm, self.calls, self.bytes_sent = comm, 0, 0

    def start(self, kind, a):
        self.calls += 1
        self.bytes_sent += np.asarray(a).nbytes
        comm = self.comm

        class Op:
            def result(self):
                return comm.all_gather(a) if kind == "gather" else comm.all_reduce(a, kind)
        return Op()


def _windows(world: int, flushes: int) -> list:
    """windows[r][k]: rank r's one-slot window of flush k; a new module appears at every flush
    (on every rank from flush 1 on, on rank 1 alone at flush 2), one rank's NaN at flush 3."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(12, generator=g) + 50
    out = [[] for _ in range(world)]
    for k in range(flushes):
        for r in range(world):
            rows = {("", "loss"): _row(torch.randn(1, generator=g)),
                    ("m", "weight"): _row(w[r * 6:(r + 1) * 6] if world == 2 else w)}
            for j in range(1, k + 1):
                act = torch.randn(5 + r, generator=g) * j
                if k == 3 and r == world - 1 and j == 1:
                    act[2] = float("nan")
                rows[(f"new{j}", "output")] = _row(act)
            if k == 2 and r == 1:
                rows[("only1", "output")] = _row(torch.randn(3, generator=g))
            kinds = {key: SH if key[1] == "weight" else LOC for key in rows}
            phases = {key: Phase.WEIGHT if key[1] == "weight" else Phase.LOSS if key[1] == "loss"
                      else Phase.FORWARD for key in rows}
            out[r].append([_lf(k + 1, 10 + k, rows, kinds, phases)])
    return out


def _run_threads(world, fn):
    shared = {"bufs": [None] * world, "barrier": threading.Barrier(world)}
    out, errors = [None] * world, []

    def one(r):
        try:
            out[r] = fn(r, ThreadComm(world, shared, r))
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
            shared["barrier"].abort()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads), "a rank hung"
    return out


def test_overlapping_flushes_equal_one_at_a_time():
    world, n = 2, 6
    wins = _windows(world, n)

    def deferred_rank(r, comm):
        tables, flights, got = reduce.Tables(), deferred.Flights(ThreadOps(comm)), []
        for k in range(n):                       # one step end each
            got += flights.advance()
            flights.start(rounds.plan(wins[r][k], tables, r, full=True, compare=True,
                                      final=False), k)
            assert len(flights) >= 1
        got += flights.drain()
        return got, tables, flights.ops.calls

    def sync_rank(r, comm):
        tables = reduce.Tables()
        return [(k, rounds.run(wins[r][k], tables, comm, r, full=True, compare=True,
                               final=False)) for k in range(n)], tables, comm.calls

    dfr = _run_threads(world, deferred_rank)
    syn = _run_threads(world, sync_rank)
    (d_done, d_tab, d_calls), (s_done, s_tab, s_calls) = dfr[0], syn[0]
    assert [k for k, _ in d_done] == list(range(n))   # oldest first
    assert sorted(d_tab.rows) == sorted(s_tab.rows)
    for (k, d_red), (_, s_red) in zip(d_done, s_done):
        got = rounds.merged(d_red, wins[0][k], d_tab, 0, world, lambda key: True)
        want = rounds.merged(s_red, wins[0][k], s_tab, 0, world, lambda key: True)
        _assert_same_frames(got, want)
        assert [f.bad_range for f in got] == [f.bad_range for f in want]
    nan = rounds.merged(d_done[3][1], wins[0][3], d_tab, 0, world, lambda key: True)[0]
    assert nan.bad_range[nan.index("new1", "output")] == (world - 1, world - 1, 1)
    assert {len(d_tab.rows)} == {len(t.rows) for _, t, _ in dfr}
    # the deferred flushes ran round 1 again where an older flush grew the table under them
    assert d_calls > s_calls, (d_calls, s_calls)
