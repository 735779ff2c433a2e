"""A run directory that already holds a run is not appended to: the new run goes to a sibling
`run_dir-2`, `-3`..., says so in one log line and in `mon.run_dir`; every rank of a job lands in
the same directory."""
import json
import logging
import os
import sys
import time

import pytest
import torch

import stabilitywatch as sw

sys.path.insert(0, os.path.dirname(__file__))
from test_monitor import batches, cfg, make, read_jsonl, train  # noqa: E402


def _run(run_dir, nan_step=None, steps=2):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=run_dir) as mon:
        for step, x in enumerate(batches(steps)):
            if step == nan_step:
                x = x.clone()
                x[0, 0] = float("nan")     # a critical alert (NaN in the batch)
            with mon.step(step, batch=x):
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    return mon


def _contents(d):
    return {p: (d / p).read_bytes() for p in ("run.json", "alerts.jsonl", "stats.jsonl")
            if (d / p).exists()}


def test_second_run_in_the_same_dir_gets_its_own(tmp_path, caplog):
    d = tmp_path / "run"
    first = _run(d, nan_step=1)
    assert first.run_dir == d
    before = _contents(d)
    assert set(before) == {"run.json", "alerts.jsonl", "stats.jsonl"}
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        second = _run(d, steps=3)
    assert second.run_dir == tmp_path / "run-2"
    assert _contents(d) == before                        # the first run's files are untouched
    assert sorted({r["step"] for r in read_jsonl(second.run_dir / "stats.jsonl")}) == [0, 1, 2]
    # the healthy run raised nothing (the JSONL sink creates alerts.jsonl up front, empty)
    assert read_jsonl(second.run_dir / "alerts.jsonl") == []
    said = [r.getMessage() for r in caplog.records if "already holds a run" in r.getMessage()]
    assert said == [f"stabilitywatch: {d} already holds a run; this run writes to {d}-2"]
    third = _run(d, nan_step=0)
    assert third.run_dir == tmp_path / "run-3"
    assert read_jsonl(third.run_dir / "alerts.jsonl")[0]["step"] == 0
    assert len(read_jsonl(d / "alerts.jsonl")) == len(before["alerts.jsonl"].splitlines())


def test_alerts_alone_mark_a_run(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "alerts.jsonl").write_text("{}\n")              # no run.json: its writing failed
    assert _run(d).run_dir == tmp_path / "run-2"


@pytest.mark.parametrize("prepare", ["missing", "empty", "unrelated"])
def test_new_empty_or_unrelated_dir_is_used_as_given(tmp_path, prepare):
    d = tmp_path / "run"
    if prepare != "missing":
        d.mkdir()
    if prepare == "unrelated":
        (d / "checkpoint.pt").write_bytes(b"x")          # the user's own files are no run
    mon = _run(d)
    assert mon.run_dir == d and (d / "stats.jsonl").exists()
    assert _run(d).run_dir == tmp_path / "run-2"          # now it holds a run


def test_taken_sibling_is_skipped(tmp_path):
    for name in ("run", "run-2"):
        _run(tmp_path / name)
    assert _run(tmp_path / "run").run_dir == tmp_path / "run-3"


def test_dot_run_dir_gets_a_child(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run(".").run_dir.resolve() == tmp_path
    assert _run(".").run_dir.resolve() == tmp_path / "run-2"


def test_capture_of_the_new_run_lands_in_its_dir(tmp_path):
    d = tmp_path / "run"
    _run(d, nan_step=1)
    second = _run(d, nan_step=1)
    (line,) = [a for a in read_jsonl(second.run_dir / "alerts.jsonl") if a["capture"]]
    assert (second.run_dir / line["capture"] / "manifest.json").exists()


# -- ranks of one job reach the same directory without talking to each other ------------------

def _manifest(d, rank=0, world=2):
    d.mkdir(parents=True, exist_ok=True)
    name = "run.json" if rank == 0 else f"run.rank{rank}.json"
    (d / name).write_text(json.dumps({"rank": rank, "world_size": world}))


def _choices(first, world, started):
    # ranks in order, each writing its manifest where it chose, as watch() does
    from stabilitywatch.rundir import fresh_run_dir
    out = []
    for rank in range(world):
        d = fresh_run_dir(first, rank, world, started=started)
        _manifest(d, rank, world)
        out.append(d)
    return out


@pytest.mark.parametrize("previous_world", [0, 1, 2, 4], ids=["fresh", "was-1", "same", "was-4"])
def test_every_rank_picks_the_same_dir(tmp_path, previous_world):
    first = tmp_path / "run"
    for rank in range(previous_world):
        _manifest(first, rank, previous_world)
    old = time.time() - 3600
    for p in first.glob("*.json"):
        os.utime(p, (old, old))
    started = time.time() - 10                            # this job's processes started after
    got = _choices(first, 2, started)
    want = first if previous_world == 0 else tmp_path / "run-2"
    assert got == [want, want]


@pytest.mark.parametrize("name", ["alerts.jsonl", "stats.jsonl"])
def test_rank0_files_without_a_manifest_are_a_previous_run_for_every_rank(tmp_path, name):
    first = tmp_path / "run"
    first.mkdir()
    (first / name).write_text("{}\n")
    assert _choices(first, 2, time.time() - 5) == [tmp_path / "run-2"] * 2


def test_rank_of_this_job_joins_the_dir_rank0_just_wrote(tmp_path):
    first = tmp_path / "run"
    from stabilitywatch.rundir import fresh_run_dir
    _manifest(first, 0, 2)                                # this job's rank 0, just now
    assert fresh_run_dir(first, 1, 2, started=time.time() - 5) == first


def test_rank_waits_for_a_manifest_being_written(tmp_path):
    import threading
    from stabilitywatch.rundir import holds_run
    first = tmp_path / "run"
    first.mkdir()
    (first / "run.json").write_text('{"rank": 0, "wor')      # rank 0 is halfway through
    done = threading.Timer(0.2, lambda: _manifest(first, 0, 2))
    done.start()
    try:
        assert not holds_run(first, 1, 2, started=time.time() - 5)
    finally:
        done.cancel()
    assert not holds_run(first, 1, 2, started=time.time() - 5)
    (first / "run.json").write_text("{broken")
    os.utime(first / "run.json", (time.time() - 3600,) * 2)   # an old broken manifest
    assert holds_run(first, 1, 2, started=time.time() - 5)


def test_rank_judges_an_old_manifest_of_the_same_world_as_a_previous_run(tmp_path):
    # the previous run's rank 1 wrote nothing (it died early); its rank 0's manifest predates
    # this process
    from stabilitywatch.rundir import holds_run
    first = tmp_path / "run"
    _manifest(first, 0, 2)
    old = time.time() - 3600
    os.utime(first / "run.json", (old, old))
    assert holds_run(first, 0, 2)
    assert holds_run(first, 1, 2, started=time.time() - 5)
    assert not holds_run(first, 1, 2, started=old - 60)


# -- the demo says where it wrote ------------------------------------------------------------

def test_demo_twice_in_one_dir_says_where_each_wrote(tmp_path):
    from stabilitywatch.demo import run_demo, summary
    out = tmp_path / "demo"
    r1 = run_demo(out, device="cpu", steps=2, fault_step=1)
    r2 = run_demo(out, device="cpu", steps=2, fault_step=1)
    assert r1.run_dir == out and r2.run_dir == tmp_path / "demo-2"
    assert f"run directory: {r2.run_dir.resolve()} " in summary(r2)
    assert (r2.run_dir / "run.json").exists() and (r2.run_dir / "stats.jsonl").exists()
    assert {r["step"] for r in read_jsonl(out / "stats.jsonl")} == {0, 1}
