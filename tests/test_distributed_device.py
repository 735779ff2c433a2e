"""The flush on the job's own group, queued and read a step end later (distributed/deferred.py),
run for real on 2 gloo processes with CPU tensors as the "device": the same plan of collectives
(rounds.plan), started asynchronously on the job's group at one step end and read at a later
one. Records and alerts equal the gloo side group's; a rank that closes early stops nobody.
One spawn, under a deadline (tests/distutil.py)."""
from __future__ import annotations

import pytest

from dist_scenarios_gpt2 import close_enough
from distutil import read_jsonl, results, run_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

SCENARIOS = [
    ("dev", "device_reads_later", {}),
    ("side", "side_group_twin", {}),
    ("nan_dev", "nan_one_rank", {"dist_backend": "default"}),
    ("nan_side", "nan_one_rank", {"dist_backend": "gloo"}),
    ("payload_dev", "payload", {"dist_backend": "default", "steps": 8}),
    ("payload_side", "payload", {"dist_backend": "gloo", "steps": 8}),
    ("gpt2_nan_dev", "gpt2_nan", {"wrap": "fsdp2", "dist_backend": "default"}),
    ("leaves_dev", "rank_leaves", {"dist_backend": "default"}),
    ("guard", "guard_flags", {}),
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_device")
    return out, run_ranks(out, SCENARIOS, world=2, timeout=150, pg_timeout=60)


def _ok(out, run, label):
    assert not run["hung"], f"ranks {run['hung']} hung (killed at the deadline)"
    res = results(out, label)
    for r, x in enumerate(res):
        assert x is not None, f"rank {r} wrote no result for {label} ({run['exitcodes']})"
        assert x["ok"], f"rank {r} failed in {label}:\n{x['error']}"
    return res


def test_every_collective_is_read_at_a_later_step_end(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "dev")
    assert r0["path"] == r1["path"] == "device"
    for x in (r0, r1):
        during = [(began, read) for began, read, closing in x["reads"] if not closing]
        assert during and all(read > began for began, read in during), x["reads"]
        # flushes overlap: one still in flight after every step end
        assert all(n >= 1 for n in x["in_flight"]), x["in_flight"]
    assert r0["reads"] == r1["reads"] and r0["collectives"] == r1["collectives"]


def test_device_path_records_and_alerts_equal_the_side_groups(spawned):
    out, run = spawned
    d0, _ = _ok(out, run, "dev")
    s0, _ = _ok(out, run, "side")
    key = ("step", "rank", "module", "tensor", "stat", "value")
    assert [tuple(a[k] for k in key) for a in d0["alerts"]] == \
        [tuple(a[k] for k in key) for a in s0["alerts"]]
    assert [a["detector"] for a in d0["alerts"]] == ["divergence"]
    assert d0["records"].keys() == s0["records"].keys() and d0["records"]
    bad = {k: close_enough(d0["records"][k], s0["records"][k]) for k in d0["records"]}
    assert not {k: v for k, v in bad.items() if v}
    assert d0["collectives"] == s0["collectives"] and d0["flushes"] == s0["flushes"]


def test_device_path_names_the_rank_of_a_nan_and_keys_of_one_rank(spawned):
    out, run = spawned
    d0, d1 = _ok(out, run, "nan_dev")
    s0, _ = _ok(out, run, "nan_side")
    assert d0["path"] == "device" and s0["path"] == "gloo"
    key = ("detector", "step", "rank", "module", "tensor", "message")
    assert [tuple(a[k] for k in key) for a in d0["alerts"]] == \
        [tuple(a[k] for k in key) for a in s0["alerts"]]
    assert d0["alerts"] and d0["alerts"][0]["rank"] == 1
    # the named rank's own counts, sent by it alone (distributed/details.py)
    (det,) = d0["alerts"][0]["extra"]["rank_details"]
    assert det["rank"] == 1 and det["nan"] == 1 and det["numel"] == 8 * 16
    assert d0["alerts"][0]["extra"] == s0["alerts"][0]["extra"]
    dev = {(r["step"], r["module"], r["tensor"]): r["stats"]
           for r in read_jsonl(out / "nan_dev" / "stats.jsonl")}
    side = {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in read_jsonl(out / "nan_side" / "stats.jsonl")}
    assert dev.keys() == side.keys() and any(k[1] == "extra" for k in dev)
    assert d0["flushes"] == d1["flushes"] == 4 and d0["collectives"] == d1["collectives"]


def test_device_path_bytes_per_step_end_are_the_side_groups(spawned):
    out, run = spawned
    p0, p1 = _ok(out, run, "payload_dev")
    s0, _ = _ok(out, run, "payload_side")
    assert p0["reduce"]["path"] == "device" and s0["reduce"]["path"] == "gloo"
    assert p0["reduce"]["sent"] == p1["reduce"]["sent"]
    # once the keys are agreed and the pipeline is full, every step end starts round 1 of one
    # flush, round 2 of the one before and round 3 of the one before that: one flush's bytes,
    # as on the side group
    steady = p0["reduce"]["sent"][-3:]
    assert steady and set(steady) == {s0["reduce"]["sent"][-1]}, (p0["reduce"], s0["reduce"])
    red, gat = p0["reduce"]["records"], s0["reduce"]["records"]
    assert red.keys() == gat.keys()
    assert not {k: v for k, v in ((k, close_enough(red[k], gat[k])) for k in red) if v}


def test_device_path_guard_and_incident_under_fsdp2(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "gpt2_nan_dev")
    assert r0["path"] == "device"
    assert r0["unchanged_at_nan"] and r1["unchanged_at_nan"] and r0["finite"]
    nf = [a for a in r0["alerts"] if a["detector"] == "nonfinite" and a["step"] == 5]
    assert nf and (nf[0]["rank"], nf[0]["module"], nf[0]["tensor"]) == (1, r0["module"], "grad")
    assert nf[0]["extra"]["shard"]["rows"] == [16, 32]


def test_device_path_a_rank_that_closes_early_stops_nobody(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "leaves_dev")
    assert r0["path"] == r1["path"] == "device"
    assert r0["detached"] and r1["detached"]
    assert r0["seconds_in_loop"] < 15     # not the 20 s timeout
    assert r0["frames_seen"] == 6         # every step's frame, merged or its own


def test_the_guards_flag_and_the_sentinels_ranks_ride_one_reduction(spawned):
    out, run = spawned
    r0, r1 = _ok(out, run, "guard")
    assert r0["unchanged_at_3"] and r1["unchanged_at_3"]       # both ranks skipped step 3
    n = r0["grads"]
    assert n == 4 and set(r0["flag_sizes"]) == set(r1["flag_sizes"]) == {2 + 2 * n}
    for rr in (r0["row_ranks"], r1["row_ranks"]):
        assert rr["3"]["2:grad.bias"] == [1, 1]
        assert all(v == [-1, -1] for s, row in rr.items() for k, v in row.items()
                   if (s, k) != ("3", "2:grad.bias"))
    assert r0["bad_rank_lo"] == 1
    # per_rank mode: rank 0's own frame is finite; its alert names rank 1's gradient
    crit = [a for a in read_jsonl(out / "guard" / "alerts.jsonl") if a["severity"] == "critical"]
    assert crit and crit[0]["step"] == 3, crit
    a = crit[0]
    assert (a["module"], a["tensor"], a["rank"]) == ("2", "grad.bias", 1)
    assert a["extra"]["source"] == "cross_rank_flags" and a["extra"]["rank_range"] == [1, 1]
    assert a["message"].startswith("NaN/Inf first appear in 2 grad.bias on rank 1"), a["message"]
