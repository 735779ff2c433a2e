"""A tiny HF GPT-2 (built from a config) under DDP and FSDP2 `fully_shard`, 2 gloo processes:
a NaN in one rank's gradient shard on an unsampled step with the guard on, and a flipped
exponent bit in one rank's weight copy (DDP) or shard (FSDP2). One spawn runs them all, under
a deadline (tests/distutil.py)."""
from __future__ import annotations

import pytest

from distutil import read_jsonl, results, run_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

SCENARIOS = [
    ("nan_ddp", "gpt2_nan", {"wrap": "ddp"}),
    ("nan_fsdp2", "gpt2_nan", {"wrap": "fsdp2"}),
    ("flip_ddp", "gpt2_bitflip", {"wrap": "ddp"}),
    ("flip_fsdp2", "gpt2_bitflip", {"wrap": "fsdp2"}),
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_gpt2")
    return out, run_ranks(out, SCENARIOS, world=2, timeout=240, pg_timeout=60)


def _ok(out, run, label):
    assert not run["hung"], f"ranks {run['hung']} hung (killed at the deadline)"
    res = results(out, label)
    for r, x in enumerate(res):
        assert x is not None, f"rank {r} wrote no result for {label} ({run['exitcodes']})"
        assert x["ok"], f"rank {r} failed in {label}:\n{x['error']}"
    return res


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_nan_in_one_ranks_gradient_shard_is_skipped_everywhere_and_named(spawned, wrap):
    out, run = spawned
    r0, r1 = _ok(out, run, f"nan_{wrap}")
    # the guard: both ranks skipped step 5, so neither moved
    assert r0["unchanged_at_nan"] and r1["unchanged_at_nan"]
    assert r0["finite"] and r1["finite"]
    if wrap == "ddp":   # replicas: bit-identical on both ranks after the run
        assert r0["digest"] == r1["digest"]
    recs = read_jsonl(out / f"nan_{wrap}" / "stats.jsonl")
    assert not [r for r in recs if r["step"] == 5 and r["tensor"] == "weight"], \
        "step 5 should be unsampled"
    nf = [a for a in r0["alerts"] if a["detector"] == "nonfinite" and a["step"] == 5]
    assert nf, r0["alerts"]
    a = nf[0]
    assert (a["severity"], a["rank"], a["module"], a["tensor"]) == \
        ("critical", 1, r0["module"], "grad"), a
    assert a["extra"]["ranks"] == [1] and a["extra"]["rank_range"] == [1, 1]
    assert a["extra"].get("skipped") is True
    assert "rank 1" in a["message"] and "of 2" in a["message"]
    if wrap == "fsdp2":   # dim 0 (32 rows) split in two: rank 1 holds rows 16..31
        assert r1["local_shape"] == [16, 128]
        assert a["extra"]["shard"] == {"rank": 1, "of": 2, "rows": [16, 32], "dim0": 32}
        assert "rows 16..31" in a["message"]
    written = read_jsonl(out / f"nan_{wrap}" / "alerts.jsonl")
    assert any(w["detector"] == "nonfinite" and w["step"] == 5 and w["rank"] == 1
               for w in written)


def test_flipped_bit_in_a_ddp_replica_is_named_by_divergence(spawned):
    out, run = spawned
    r0, _ = _ok(out, run, "flip_ddp")
    div = [a for a in r0["alerts"] if a["detector"] == "divergence"]
    assert div, r0["alerts"]
    a = div[0]
    assert (a["step"], a["rank"], a["module"], a["tensor"]) == (3, 1, r0["module"], "weight")
    assert a["extra"]["ranks"] == [1] and a["extra"]["reference_ranks"] == [0]


def test_flipped_bit_in_an_fsdp2_shard_is_named_by_physics(spawned):
    out, run = spawned
    r0, _ = _ok(out, run, "flip_fsdp2")
    phys = [a for a in r0["alerts"] if a["detector"] == "physics"
            and (a["module"], a["tensor"]) == (r0["module"], "weight")]
    assert phys, r0["alerts"]
    a = phys[0]
    assert a["step"] == 3 and a["severity"] == "critical" and a["rank"] == 1, a
    assert a["extra"]["shard"]["rank"] == 1 and a["extra"]["shard"]["rows"] == [16, 32]
    assert "largest |x| on rank 1" in a["message"]
