"""The flush by reduction (distributed/rounds.py) against the all-gather merge, in one process.

Each rank is a thread; their collectives meet at a barrier and reduce with numpy, so worlds of
up to 64 ranks run in well under a second. The multi-process runs on gloo are in
test_distributed.py (every scenario there runs with the reduction, the default) and
test_distributed_scale.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from stabilitywatch.detectors.divergence import DivergenceDetector
from stabilitywatch.distributed import reduce, rounds, wire
from stabilitywatch.distributed.merge import LocalFrame, merged_frames, payload_rows
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.derive import derive_many
from stabilitywatch.stats.layout import N_STATS, Stat
from stabilitywatch.stats.reference import reference_row
from stabilitywatch.stats.sentinel import SentinelFrame

LOC, SH, REP = wire.LOCAL | wire.OWNER, wire.SHARDED | wire.OWNER, wire.REPLICATED


class ThreadComm:
    """Collectives between threads: every rank hands in its buffer, all reduce the same stack."""

    def __init__(self, world: int, shared: dict, rank: int):
        self.world, self.shared, self.rank = world, shared, rank
        self.calls = 0
        self.bytes_sent = 0

    def _meet(self, a):
        sh = self.shared
        sh["bufs"][self.rank] = a
        sh["barrier"].wait(timeout=20)
        stack = [np.array(b) for b in sh["bufs"]]
        sh["barrier"].wait(timeout=20)
        self.calls += 1
        self.bytes_sent += a.nbytes
        shapes = {b.shape for b in stack}
        assert len(shapes) == 1, f"ranks disagree on the shape: {shapes}"
        return stack

    def all_reduce(self, a, op):
        stack = self._meet(np.asarray(a, dtype=np.float64))
        out = stack[0].copy()
        for b in stack[1:]:
            out = out + b if op == "sum" else np.maximum(out, b)
        return out

    def all_gather(self, buf):
        return self._meet(np.asarray(buf, dtype=np.uint8))


def run_world(windows: list, full=True, compare=True, finals=None):
    """windows[r]: rank r's window (LocalFrames or None per slot). Returns per-rank
    (Reduced, Tables, comm)."""
    world = len(windows)
    shared = {"bufs": [None] * world, "barrier": threading.Barrier(world)}
    out, errors = [None] * world, []

    def one(r):
        try:
            comm = ThreadComm(world, shared, r)
            t = reduce.Tables()
            red = rounds.run(windows[r], t, comm, r, full=full, compare=compare,
                             final=bool(finals and finals[r]))
            out[r] = (red, t, comm)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
            shared["barrier"].abort()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    if errors:
        raise errors[0]
    return out


def _row(t) -> np.ndarray:
    return reference_row(torch.as_tensor(t, dtype=torch.float32)).numpy()


def _sentinel(step, keys, nonfinite):
    n = len(keys)
    return SentinelFrame(step=step, keys=list(keys), nonfinite=np.asarray(nonfinite, float),
                         absmax=np.ones(n), sumsq=np.ones(n), present=np.ones(n, bool),
                         nan=np.asarray(nonfinite, float), numel=np.full(n, 10))


def _lf(end, step, rows: dict, kinds: dict, phases: dict, sentinel=None):
    keys = list(rows)
    f = StatsFrame(step=step, keys=keys, rows=np.stack([rows[k] for k in keys]),
                   scales=[1.0] * len(keys), phases=[phases[k] for k in keys], sentinel=sentinel)
    return LocalFrame(end=end, frame=f, key_ids=[wire.key_id(*k) for k in keys],
                      kinds=[kinds[k] for k in keys])


def _frames_of_world(world: int, seed: int = 0, nan_rank=None, odd_rank=None):
    """Two step ends per rank: activations (different on each rank), a sharded weight, a
    replicated bias, a row only some ranks have, an empty shard."""
    g = torch.Generator().manual_seed(seed)
    full_w = torch.randn(4 * world + 3, generator=g) * 3 + 100   # a mean far from 0
    bias = torch.randn(5, generator=g)
    out = []
    for r in range(world):
        per = -(-len(full_w) // world)
        win = []
        for end in (1, 2):
            act = torch.randn(7 + r, generator=g) * (r + 1)
            if r in np.atleast_1d(nan_rank if nan_rank is not None else []) and end == 2:
                act[3 + r % 2] = float("nan")
                act[5] = float("inf") if r % 2 else act[5]
            b = bias.clone()
            if odd_rank == r and end == 2:
                b.view(torch.int32)[2] ^= 1
            rows = {("m", "output"): _row(act), ("m", "weight"): _row(full_w[r * per:(r + 1) * per]),
                    ("m", "bias"): _row(b), ("", "loss"): _row(act[:1])}
            if r % 3 == 1:
                rows[("only", "output")] = _row(act * 10)
            kinds = {k: SH if k[1] == "weight" else REP if k[1] == "bias" else LOC for k in rows}
            phases = {k: Phase.WEIGHT if k[1] in ("weight", "bias") else
                      Phase.LOSS if k[1] == "loss" else Phase.FORWARD for k in rows}
            win.append(_lf(end, 10 + end, rows, kinds, phases))
        out.append(win)
    return out


def _gathered(frames_by_rank: list):
    payloads = []
    for r, lfs in enumerate(frames_by_rank):
        parts = [payload_rows(lf, True) for lf in lfs]
        names = sorted({(k, *n) for lf in lfs for k, n in zip(lf.key_ids, lf.frame.keys)})
        buf, _ = wire.encode(r, False, np.concatenate([p[0] for p in parts]),
                             np.concatenate([p[1] for p in parts]), [list(n) for n in names],
                             1 << 22)
        payloads.append(wire.decode(buf))
    names = {k: (m, ro) for p in payloads for k, m, ro in p.names}
    return merged_frames(payloads, names, frames_by_rank[0], rank=0, world=len(frames_by_rank))


_FLOAT_SUMS = [int(s) for s in (Stat.SUM, Stat.SUMSQ, Stat.SHIFT_SUM, Stat.SHIFT_SUMSQ)]
_PLAIN = [i for i in range(N_STATS) if i not in _FLOAT_SUMS]


def _assert_same_frames(got, want):
    assert [f.step for f in got] == [f.step for f in want]
    for a, b in zip(got, want):
        assert a.keys == b.keys and a.phases == b.phases and a.kinds == b.kinds
        assert np.array_equal(a.rows[:, _PLAIN], b.rows[:, _PLAIN]), (a.keys, a.rows - b.rows)
        # the same shift (the lowest rank's); float sums in another order at most
        np.testing.assert_allclose(a.rows[:, _FLOAT_SUMS], b.rows[:, _FLOAT_SUMS], rtol=1e-12,
                                   atol=1e-9)
        da, db = derive_many(a.rows, a.scales), derive_many(b.rows, b.scales)
        for i in range(len(a.keys)):
            assert da[i]["std"] == pytest.approx(db[i]["std"], rel=1e-9, abs=1e-12), a.keys[i]
            assert da[i]["mean"] == pytest.approx(db[i]["mean"], rel=1e-12), a.keys[i]
        assert {i: sorted(v) for i, v in a.bad_ranks.items()} == \
            {i: sorted(v) for i, v in b.bad_ranks.items()}


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64], ids=lambda w: f"world{w}")
def test_reduced_rows_equal_the_gathered_merge(world):
    frames = _frames_of_world(world, seed=world, nan_rank=world - 1)
    res = run_world(frames)
    red, tables, _ = res[0]
    got = rounds.merged(red, frames[0], tables, 0, world, lambda k: False)
    _assert_same_frames(got, _gathered(frames))
    f = got[1]
    i = f.index("m", "output")
    assert f.bad_range[i] == (world - 1, world - 1, 1) and f.bad_ranks[i] == [world - 1]


@pytest.mark.parametrize("world,bad", [(8, (2, 5, 6)), (3, (0,))], ids=["w8", "w3-r0"])
def test_details_of_a_bad_row_come_from_the_named_ranks_alone(world, bad):
    """The lowest and highest rank holding NaN/Inf send their own counts in one more SUM, only
    for the bad rows; a healthy flush runs no such round."""
    healthy = run_world(_frames_of_world(world, seed=1))
    frames = _frames_of_world(world, seed=1, nan_rank=bad)
    res = run_world(frames)
    assert {c.calls for _, _, c in res} == {c.calls + 1 for _, _, c in healthy}
    grown = {a.bytes_sent - b.bytes_sent for (_, _, a), (_, _, b) in zip(res, healthy)}
    # one bad row (the output, at end 2; the loss row reads act[:1], finite): 2 ranks x 5 fields
    assert grown == {2 * 5 * 8}, grown
    red, tables, _ = res[0]
    got = rounds.merged(red, frames[0], tables, 0, world, lambda k: False)
    f = got[1]
    i = f.index("m", "output")
    ends = sorted({bad[0], bad[-1]})
    assert [d["rank"] for d in f.bad_detail[i]] == ends
    for d in f.bad_detail[i]:
        own = frames[d["rank"]][1].frame
        row = own.rows[own.keys.index(("m", "output"))]
        assert (d["numel"], d["nan"], d["posinf"]) == \
            (row[Stat.NUMEL], row[Stat.NAN], row[Stat.POSINF])
    assert f.bad_range[i] == (bad[0], bad[-1], len(bad))
    assert not got[0].bad_detail


def test_sentinel_details_name_the_gradient_on_the_bad_ranks():
    keys = [("blk.0", "grad"), ("blk.1", "grad"), ("head", "grad")]
    windows = []
    for r in range(5):
        bad = [0, (r + 1) if r in (1, 3) else 0, 0]
        lf = _lf(1, 7, {("", "loss"): _row([1.0 + r])}, {("", "loss"): LOC},
                 {("", "loss"): Phase.LOSS}, sentinel=_sentinel(7, keys, bad))
        windows.append([lf])
    red, tables, _ = run_world(windows)[0]
    (f,) = rounds.merged(red, windows[0], tables, 0, 5, lambda k: True)
    assert f.sentinel_bad == {("blk.1", "grad"): (1, 3, 2)}
    assert f.sentinel_detail[("blk.1", "grad")] == [
        {"rank": 1, "numel": 10, "nonfinite": 2, "nan": 2, "absmax": 1.0},
        {"rank": 3, "numel": 10, "nonfinite": 4, "nan": 4, "absmax": 1.0}]


def test_payload_per_rank_does_not_grow_with_the_world():
    sent = {}
    for world in (2, 8, 32):
        frames = _frames_of_world(world)
        # the same rows on every rank: the row only some ranks have would change the table
        for win in frames:
            for lf in win:
                keep = [i for i, k in enumerate(lf.frame.keys) if k != ("only", "output")]
                lf.frame.keys = [lf.frame.keys[i] for i in keep]
                lf.frame.rows = lf.frame.rows[keep]
                lf.frame.scales = [lf.frame.scales[i] for i in keep]
                lf.frame.phases = [lf.frame.phases[i] for i in keep]
                lf.key_ids = [lf.key_ids[i] for i in keep]
                lf.kinds = [lf.kinds[i] for i in keep]
                lf.seqs = []
                lf.__post_init__()
        res = run_world(frames)
        sent[world] = {c.bytes_sent for _, _, c in res}
        assert len(sent[world]) == 1, sent
    assert sent[2] == sent[8] == sent[32], sent
    (b,) = sent[2]
    rows = 4 * 2   # 4 rows x 2 step ends
    assert b < rows * (reduce.WA + reduce.WB) * 8 + 2000, b


@pytest.mark.parametrize("world,odd", [(2, 1), (5, 3), (5, 0)], ids=["w2-r1", "w5-r3", "w5-r0"])
def test_divergence_by_extremes_names_the_odd_rank(world, odd):
    frames = _frames_of_world(world, odd_rank=odd)
    res = run_world(frames)
    red, tables, comm = res[0]
    got = rounds.merged(red, frames[0], tables, 0, world, lambda k: False)
    alerts = [a for f in got for a in DivergenceDetector().check(f)]
    want = [a for f in _gathered(frames) for a in DivergenceDetector().check(f)]
    assert len(alerts) == len(want) == 1
    a, w = alerts[0], want[0]
    assert (a.step, a.rank, a.module, a.tensor, a.stat, a.value) == \
        (w.step, w.rank, w.module, w.tensor, w.stat, w.value) == (12, odd, "m", "bias",
                                                                     w.stat, w.value)
    assert a.extra["ranks"] == [odd]
    assert f"{world - 1} of {world} replicas agree" in a.message or world == 2
    # the extremes' rounds ran only for the flush with a difference
    assert red.groups and all(k[0] == 1 for k in red.groups)


def test_no_divergence_rounds_and_no_rows_on_unsampled_steps():
    """Identical replicas: two rounds beyond the first; no rows at all: the first alone."""
    frames = _frames_of_world(2)
    res = run_world(frames)
    # round 1, the gather of new names (rank 1 alone has "only"), round 1 again, MAX, SUM
    assert {c.calls for _, _, c in res} == {5}
    empty = [[None, None] for _ in range(2)]
    res2 = run_world(empty)
    assert {c.calls for _, _, c in res2} == {1}
    assert {c.bytes_sent for _, _, c in res2} == {8 * (reduce.N_HEAD + 2)}


def test_keys_agree_without_gathering_when_every_rank_has_them():
    frames = _frames_of_world(4)
    for win in frames:      # drop the row only some ranks have
        for lf in win:
            lf.frame = StatsFrame(step=lf.frame.step, keys=lf.frame.keys[:4],
                                  rows=lf.frame.rows[:4], scales=lf.frame.scales[:4],
                                  phases=lf.frame.phases[:4])
            lf.key_ids, lf.kinds = lf.key_ids[:4], lf.kinds[:4]
    res = run_world(frames)
    # round 1, round 1 again on the grown table, MAX, SUM: no all-gather
    assert {c.calls for _, _, c in res} == {4}
    assert {tuple(t.rows) for _, t, _ in res} and len({tuple(t.rows) for _, t, _ in res}) == 1


def test_sentinel_of_one_rank_names_rank_and_gradient():
    keys = [("blk.0", "grad"), ("blk.1", "grad"), ("head", "grad")]
    windows = []
    for r in range(4):
        bad = [0, 3 if r == 2 else 0, 0]
        lf = _lf(1, 7, {("", "loss"): _row([1.0 + r])}, {("", "loss"): LOC},
                 {("", "loss"): Phase.LOSS}, sentinel=_sentinel(7, keys, bad))
        windows.append([lf])
    res = run_world(windows)
    red, tables, _ = res[0]
    assert red.trip == [0]
    (f,) = rounds.merged(red, windows[0], tables, 0, 4, lambda k: True)
    assert list(f.sentinel.nonfinite) == [0, 3, 0]      # sharded: sums
    assert f.sentinel.first_bad() == 1
    assert f.sentinel_bad == {("blk.1", "grad"): (2, 2, 1)}
    (g,) = rounds.merged(red, windows[0], tables, 0, 4, lambda k: False)
    assert list(g.sentinel.nonfinite) == [0, 3, 0]      # replicated: the max


def test_a_rank_that_closes_is_seen_by_the_others():
    frames = _frames_of_world(2)
    res = run_world(frames, finals=[False, True])
    assert res[0][0].others_final and not res[1][0].others_final


def test_per_rank_mode_exchanges_fingerprints_only():
    frames = _frames_of_world(3, odd_rank=2)
    res = run_world(frames, full=False)
    for r, (red, tables, _) in enumerate(res):
        assert red.bsum is None            # no sums: each rank writes its own rows
        fr = rounds.local(red, frames[r], tables, r, 3)
        alerts = [a for f in fr for a in DivergenceDetector().check(f)]
        if r in (0, 2):
            assert [(a.rank, a.module, a.tensor) for a in alerts] == [(2, "m", "bias")]
        else:
            assert alerts == []


def test_the_distributed_layer_takes_a_run_info_not_the_monitor():
    import ast
    import pathlib

    import stabilitywatch as sw
    from stabilitywatch.distributed import make_coordinator
    from stabilitywatch.distributed.runinfo import RunInfo
    from stabilitywatch.stats.buffer import StatsBuffer
    pkg = pathlib.Path(rounds.__file__).parent
    for f in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert "monitor" not in node.module.split("."), (f.name, node.module)
    released = []
    run = RunInfo(rank=0, world_size=1, config=sw.Config(), has_optimizer=False,
                  release=released.append)
    coord = make_coordinator(run)
    assert not coord.active and coord.run is run
    buf = StatsBuffer(capacity=4)
    assert coord.frames(buf, final=True) == []
