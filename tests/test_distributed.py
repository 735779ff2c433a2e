"""torch.distributed on the CPU: 2 processes on gloo (127.0.0.1), started by the tests.

One spawn runs the multi-process scenarios of tests/dist_scenarios.py in order (DDP with a
flipped bit, per-rank files, NaN on one rank with rank-specific modules, real FSDP2 fully_shard,
DTensor shards by hand, a rank that leaves early); a second one kills a rank. Both have hard
deadlines: a hang fails the tests instead of blocking CI. The rest are single-process checks of
the wire format, the merge and the divergence detector.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import stabilitywatch as sw
from distutil import read_jsonl, results, run_ranks
from stabilitywatch.detectors.divergence import DivergenceDetector, differing
from stabilitywatch.distributed import wire
from stabilitywatch.distributed.merge import DistFrame, LocalFrame, merged_frames, payload_rows
from stabilitywatch.stats.buffer import Phase, StatsFrame
from stabilitywatch.stats.layout import N_STATS, Stat, init_row, merge_rows
from stabilitywatch.stats.reference import reference_row

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

SCENARIOS = [
    ("ddp", "ddp_bitflip", {}),
    ("ddp_per_rank", "ddp_bitflip", {"dist_mode": "per_rank"}),
    ("ddp_gather", "ddp_bitflip", {"dist_merge": "gather"}),
    ("nan", "nan_one_rank", {}),
    ("fsdp2", "fsdp2", {}),
    ("dtensor", "dtensor_by_hand", {}),
    ("leaves", "rank_leaves", {}),
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run = run_ranks(out, SCENARIOS, world=2, timeout=90)
    return out, run


def _ok(out, run, label):
    assert not run["hung"], f"ranks {run['hung']} hung (killed at the deadline)"
    res = results(out, label)
    for r, x in enumerate(res):
        assert x is not None, f"rank {r} wrote no result for {label} (exit codes {run['exitcodes']})"
        assert x["ok"], f"rank {r} failed in {label}:\n{x['error']}"
    return res


# -- DDP ----------------------------------------------------------------------------------------
@needs_gloo
def test_ddp_bit_flip_is_named_by_the_divergence_detector(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "ddp")
    div = [a for a in r0["alerts"] if a["detector"] == "divergence"]
    assert len(div) == 1, r0["alerts"]
    a = div[0]
    assert (a["step"], a["rank"], a["module"], a["tensor"]) == (4, 1, "module.0", "weight"), a
    assert a["severity"] == "critical" and a["stat"] == "bits_lo" and abs(a["value"]) == 1
    assert a["extra"]["ranks"] == [1] and a["extra"]["reference_ranks"] == [0]
    assert "rank 1" in a["message"]
    assert r1["alerts"] == []                       # rank0 mode: rank 0 speaks for the job
    written = read_jsonl(out / "ddp" / "alerts.jsonl")
    assert [(w["detector"], w["rank"], w["module"], w["tensor"]) for w in written] == \
        [("divergence", 1, "module.0", "weight")]
    assert not (out / "ddp" / "alerts.rank1.jsonl").exists()
    assert not (out / "ddp" / "stats.rank1.jsonl").exists()
    assert r0["flushes"] == r1["flushes"] == 9 and r0["collectives"] == r1["collectives"]


@needs_gloo
def test_ddp_reduction_and_all_gather_agree(spawned):
    """dist.merge="gather" (one all-gather of every rank's rows) gives the same records and
    the same divergence alert as the default reduction."""
    out, run = spawned
    g0, _ = _ok(out, run, "ddp_gather")
    r0, _ = _ok(out, run, "ddp")
    key = ("step", "rank", "module", "tensor", "stat", "value")
    assert [tuple(a[k] for k in key) for a in g0["alerts"]] == \
        [tuple(a[k] for k in key) for a in r0["alerts"]]
    red = {(r["step"], r["module"], r["tensor"]): r["stats"]
           for r in read_jsonl(out / "ddp" / "stats.jsonl")}
    gat = {(r["step"], r["module"], r["tensor"]): r["stats"]
           for r in read_jsonl(out / "ddp_gather" / "stats.jsonl")}
    assert red.keys() == gat.keys()
    for k in red:
        for s in red[k]:
            assert red[k][s] == pytest.approx(gat[k][s], rel=1e-9, nan_ok=True), (k, s)
    assert r0["collectives"] > g0["collectives"]    # a few small reductions per flush


@needs_gloo
def test_ddp_rows_are_merged_on_rank0(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "ddp")
    recs = read_jsonl(out / "ddp" / "stats.jsonl")
    assert recs and all(r["rank"] == 0 and r["world_size"] == 2 and r["merged"] for r in recs)
    keys = [(r["step"], r["module"], r["tensor"]) for r in recs]
    assert len(keys) == len(set(keys)), "a (step, module, tensor) row was written twice"
    assert sorted({r["step"] for r in recs}) == list(range(8))
    by = {(r["step"], r["module"], r["tensor"]): r["stats"] for r in recs}
    for step in range(8):
        loss = by[(step, "", "loss")]      # activations and the loss: every rank's values
        assert loss["numel"] == 2
        assert loss["sum"] == pytest.approx(r0["losses"][step] + r1["losses"][step], rel=1e-6)
        assert by[(step, "module.2", "output")]["numel"] == 2 * r0["out_numel"]
        assert by[(step, "", "input")]["numel"] == 2 * 8 * 16
        # replicated tensors: one replica's row, not the sum of identical ones
        assert by[(step, "module.0", "weight")]["numel"] == 32 * 16
        assert by[(step, "module.0", "grad")]["numel"] == 32 * 16
        assert by[(step, "module.0", "optim.exp_avg")]["numel"] == 32 * 16
    k = r0["kinds"]
    assert k["module.0:weight"] == k["module.0:grad"] == k["module.0:optim.exp_avg"] == \
        k["module.2:grad.bias"] == "replicated"
    assert k["module.0:output"] == k["module.0:grad_output"] == k[":loss"] == "local"


@needs_gloo
def test_ddp_per_rank_mode_writes_per_rank_files(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "ddp_per_rank")
    d = out / "ddp_per_rank"
    s0, s1 = read_jsonl(d / "stats.jsonl"), read_jsonl(d / "stats.rank1.jsonl")
    assert s0 and s1
    assert {r["rank"] for r in s0} == {0} and {r["rank"] for r in s1} == {1}
    assert all(r["merged"] is False for r in s0 + s1)
    loss0 = [r for r in s0 if r["tensor"] == "loss"]
    assert loss0 and all(r["stats"]["numel"] == 1 for r in loss0)    # own rows, not merged
    for rank, f in ((0, "alerts.jsonl"), (1, "alerts.rank1.jsonl")):
        div = [a for a in read_jsonl(d / f) if a["detector"] == "divergence"]
        assert [(a["step"], a["rank"], a["module"], a["tensor"]) for a in div] == \
            [(4, 1, "module.0", "weight")], (rank, div)


# -- one rank sees NaN; modules only one rank runs; flushes every 3 steps -------------------------
@needs_gloo
def test_nan_on_one_rank_does_not_deadlock(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "nan")
    assert any(math.isnan(x) for x in r1["losses"]) and not any(math.isnan(x) for x in r0["losses"])
    # the same collectives on both ranks: 9 steps / 3 + the one at close
    assert r0["flushes"] == r1["flushes"] == 4
    assert r0["collectives"] == r1["collectives"]
    assert not r0["detached"] and not r1["detached"]
    nf = [a for a in r0["alerts"] if a["detector"] == "nonfinite"]
    assert nf and (nf[0]["step"], nf[0]["module"], nf[0]["tensor"]) == (4, "", "input")
    assert nf[0]["rank"] == 1 and nf[0]["extra"]["ranks"] == [1], nf[0]
    recs = read_jsonl(out / "nan" / "stats.jsonl")
    by = {(r["step"], r["module"], r["tensor"]): r["stats"] for r in recs}
    assert sorted({r["step"] for r in recs}) == list(range(9))
    assert ("extra", "output") not in {(m, t) for s, m, t in by if s < 2}
    for step in range(2, 9):   # a module only rank 1 ran: its rows alone, named on rank 0
        assert by[(step, "extra", "output")]["numel"] == 8 * 16
        assert by[(step, "a", "output")]["numel"] == 2 * 8 * 16


# -- FSDP2 --------------------------------------------------------------------------------------
@needs_gloo
def test_fsdp2_merged_rows_equal_the_unsharded_tensor(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "fsdp2")
    assert r0["is_dtensor"] == "DTensor"               # real fully_shard ran
    assert r0["compared"] == 3 * 4 * 4                 # steps x params x (weight, grad, 2 states)
    assert r0["mismatch"] == {}, r0["mismatch"]
    assert set(r0["kinds"].values()) == {"sharded"}
    assert [a for a in r0["alerts"] if a["detector"] == "divergence"] == []


@needs_gloo
def test_dtensor_shards_by_hand(spawned):
    """FSDP2-style parameters made by hand: an uneven shard, an empty shard, a replica."""
    out, run = spawned
    r0, r1 = _ok(out, run, "dtensor")
    assert r0["local_shapes"]["weight"] == [2, 5] and r1["local_shapes"]["weight"] == [1, 5]
    assert r1["local_shapes"]["tiny"] == [0, 4]
    assert r0["compared"] == 6 and r0["mismatch"] == {}, r0
    div = [a for a in r0["alerts"] if a["detector"] == "divergence"]
    assert [(a["step"], a["rank"], a["module"], a["tensor"]) for a in div] == [(1, 1, "0", "rep")]


# -- ranks that leave or die --------------------------------------------------------------------
@needs_gloo
def test_rank_leaving_early_does_not_stall_the_others(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "leaves")
    assert r0["detached"] and r0["frames_seen"] == 6
    assert r0["seconds_in_loop"] < 10          # well under dist_timeout (20 s): no waiting
    recs = read_jsonl(out / "leaves" / "stats.jsonl")
    assert sorted({r["step"] for r in recs}) == list(range(6))


@needs_gloo
def test_a_killed_rank_leaves_the_others_going(tmp_path):
    # the deadline covers process start-up on a loaded machine; the loop's own time is bounded
    # below (dist_timeout is 5 s)
    run = run_ranks(tmp_path, [("rank_dies", {})], world=2, timeout=90)
    assert not run["hung"], run
    assert run["exitcodes"][1] == 17
    r0 = results(tmp_path, "rank_dies")[0]
    assert r0 is not None and r0["ok"], r0
    assert r0["detached"] and r0["seconds_in_loop"] < 30, r0
    recs = read_jsonl(tmp_path / "rank_dies" / "stats.jsonl")    # every line parses
    assert sorted({r["step"] for r in recs}) == list(range(6))
    assert any(r["merged"] for r in recs) and any(not r["merged"] for r in recs)


# -- single process: wire, merge, detector -------------------------------------------------------
def _row(t) -> np.ndarray:
    return reference_row(torch.as_tensor(t, dtype=torch.float32)).numpy()


def test_wire_round_trip_and_truncation():
    full = np.arange(2 * (wire.N_META + N_STATS), dtype=np.float64).reshape(2, -1)
    fp = np.ones((3, wire.N_META + len(wire.FP_STATS)))
    names = [[wire.key_id("a", "output"), "a", "output"]]
    buf, need = wire.encode(1, True, full, fp, names, 1 << 16)
    p = wire.decode(buf)
    assert (p.rank, p.final, p.truncated, p.need) == (1, True, False, need)
    assert np.array_equal(p.full, full) and np.array_equal(p.fp, fp)
    assert p.names == [tuple(names[0])]
    small, need2 = wire.encode(0, False, full, fp, names, 128)
    q = wire.decode(small)
    assert q.truncated and q.need == need2 == need and len(small) == 128
    with pytest.raises(wire.WireError):
        wire.decode(np.zeros(256, dtype=np.uint8))       # not ours: a mismatched collective
    assert wire.key_id("a", "output") == wire.key_id("a", "output") < 2**52
    assert wire.key_id("a", "output") != wire.key_id("a", "grad")


def _local(end, step, rows: dict, kinds: dict, phase=Phase.FORWARD):
    keys = list(rows)
    f = StatsFrame(step=step, keys=keys, rows=np.stack([rows[k] for k in keys]),
                   scales=[1.0] * len(keys), phases=[phase] * len(keys))
    return LocalFrame(end=end, frame=f, key_ids=[wire.key_id(*k) for k in keys],
                      kinds=[kinds[k] for k in keys])


def _payload(rank, lfs, send_full=True):
    parts = [payload_rows(lf, send_full) for lf in lfs]
    names = sorted({(k, *n) for lf in lfs for k, n in zip(lf.key_ids, lf.frame.keys)})
    buf, _ = wire.encode(rank, False, np.concatenate([p[0] for p in parts]),
                         np.concatenate([p[1] for p in parts]), [list(n) for n in names], 1 << 20)
    return wire.decode(buf)


def test_merge_sums_local_and_sharded_rows_and_keeps_replicas():
    g = torch.Generator().manual_seed(0)
    full_w = torch.randn(10, generator=g)
    act = [torch.randn(6, generator=g), torch.randn(4, generator=g) * 100]
    LOC, SH, REP = wire.LOCAL | wire.OWNER, wire.SHARDED | wire.OWNER, wire.REPLICATED
    lfs = []
    for r in range(2):
        rows = {("m", "output"): _row(act[r]), ("m", "weight"): _row(full_w[r * 6:(r + 1) * 6]),
                ("m", "bias"): _row([1.0, 2.0 + r])}
        if r == 1:
            rows[("only1", "output")] = _row([5.0])
        kinds = {k: (SH if k[1] == "weight" else REP if k[1] == "bias" else LOC) for k in rows}
        lfs.append(_local(7, 3, rows, kinds))
    payloads = [_payload(r, [lfs[r]]) for r in range(2)]
    names = {k: (m, r) for p in payloads for k, m, r in p.names}
    (f,) = merged_frames(payloads, names, [lfs[0]], rank=0, world=2)
    assert isinstance(f, DistFrame) and f.merged and f.step == 3
    out = f.rows[f.index("m", "output")]
    want = merge_rows(np.stack([_row(act[0]), _row(act[1])]))
    assert np.array_equal(out, want)
    assert np.array_equal(f.rows[f.index("m", "weight")], _row(full_w))  # exact: fingerprints too
    assert f.rows[f.index("only1", "output")][Stat.NUMEL] == 1
    i = f.index("m", "bias")
    assert f.rows[i][Stat.NUMEL] == 2 and set(f.replicas[i]) == {0, 1}
    (alert,) = DivergenceDetector().check(f)
    assert (alert.rank, alert.module, alert.tensor) == (1, "m", "bias")


def test_divergence_majority_and_tolerance():
    a = _row([1.0, 2.0, 3.0])[wire.FP_INDEX]
    b = a.copy()
    b[list(wire.FP_STATS).index(Stat.SUM)] *= 1 + 1e-13     # atomics' last-bit noise: same
    c = a.copy()
    c[list(wire.FP_STATS).index(Stat.BITS_LO)] += 1         # one flipped bit: different
    assert differing(a, b) == [] and differing(a, c) == ["bits_lo"]
    f = DistFrame(step=9, keys=[("blk", "grad")], rows=np.stack([init_row()]), scales=[1.0],
                  phases=[Phase.GRAD], merged=True, world_size=3, replicas={0: {0: c, 1: a, 2: b}})
    (alert,) = DivergenceDetector().check(f)
    assert alert.rank == 0 and alert.extra["reference_ranks"] == [1, 2]   # majority wins
    assert alert.detector == "divergence" and alert.severity is sw.Severity.CRITICAL
    f.replicas = {0: {0: a, 1: b}}
    assert DivergenceDetector().check(f) == []


def test_dist_config_fields():
    c = sw.Config()
    assert (c.dist.mode.value, c.dist.flush_every, c.dist.divergence, c.dist.backend.value) == \
        ("rank0", 1, True, "auto")
    with pytest.raises(ValueError, match=r"dist\.mode"):
        sw.Config(dist={"mode": "everyone"})
    with pytest.raises(ValueError, match=r"dist\.flush_every"):
        sw.Config(dist={"flush_every": 0})
    with pytest.raises(ValueError, match=r"dist\.timeout"):
        sw.Config(dist={"timeout": math.inf})
    assert sw.Config.from_dict({"dist": {"mode": "per_rank"}}).dist.mode.value == "per_rank"


def test_merge_counts_hsdp_replicas_of_a_shard_once():
    """A shard held by two replicas (HSDP): only the owner's row enters the merge."""
    shard = torch.randn(5, generator=torch.Generator().manual_seed(3))
    SH = wire.SHARDED
    lfs = [_local(2, 11, {("m", "weight"): _row(shard)}, {("m", "weight"): SH | (wire.OWNER * (r == 0))})
           for r in range(2)]
    payloads = [_payload(r, [lfs[r]]) for r in range(2)]
    names = {k: (m, r) for p in payloads for k, m, r in p.names}
    (f,) = merged_frames(payloads, names, [lfs[0]], rank=0, world=2)
    assert np.array_equal(f.rows[f.index("m", "weight")], _row(shard))
