"""The flush by reduction on real gloo process groups of 2 and 8 ranks: the bytes each rank
sends per flushed step do not depend on the world size, and rank 0's merged records equal the
all-gather merge's. One spawn per world size, each under a deadline (tests/distutil.py)."""
from __future__ import annotations

import pytest

from dist_scenarios_gpt2 import close_enough
from distutil import results, run_ranks

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

WORLDS = (2, 8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    got = {}
    for world in WORLDS:
        out = tmp_path_factory.mktemp(f"scale{world}")
        run = run_ranks(out, [("payload", {})], world=world, timeout=240, pg_timeout=60)
        assert not run["hung"], f"world {world}: ranks {run['hung']} hung"
        res = results(out, "payload", world=world)
        for r, x in enumerate(res):
            assert x is not None and x["ok"], f"world {world} rank {r}: {x and x.get('error')}"
        got[world] = res
    return got


def test_bytes_per_rank_per_flush_do_not_grow_with_the_world(runs):
    sent = {w: [x["reduce"]["sent"] for x in res] for w, res in runs.items()}
    for w, per_rank in sent.items():
        assert all(s == per_rank[0] for s in per_rank), (w, per_rank)   # every rank alike
    assert sent[2][0] == sent[8][0], sent
    # the flushes after the first (which agrees on the keys) send the same bytes each
    steady = sent[2][0][2:]
    assert steady and len(set(steady)) == 1 and steady[0] > 0, sent[2][0]
    # the all-gather's contribution per rank is as small, but each rank receives world x it
    gathered = {w: res[0]["gather"]["sent"] for w, res in runs.items()}
    assert gathered[2] == gathered[8]


def test_reduced_records_equal_the_gathered_ones(runs):
    for w, res in runs.items():
        red, gat = res[0]["reduce"]["records"], res[0]["gather"]["records"]
        assert red.keys() == gat.keys(), (w, sorted(set(red) ^ set(gat)))
        bad = {k: close_enough(red[k], gat[k]) for k in red}
        bad = {k: v for k, v in bad.items() if v}
        assert not bad, (w, bad)
        loss = [v for k, v in red.items() if k.endswith(":loss")]
        assert loss and all(v["numel"] == w for v in loss)
