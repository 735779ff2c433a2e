"""The flush on the job's NCCL group, queued on the device and read a step end later
(distributed/deferred.py), on CUDA with torch.cuda.set_sync_debug_mode("error") around the
monitored steps: any host sync in them raises. One GPU: a one-rank NCCL job (the coordinator a
job of several ranks gets, made by the scenario); two GPUs: DDP with a flipped bit, skipped
where two GPUs are absent. Run on the GPU machine:

    STABILITYWATCH_REAL_TRITON=1 PYTHONPATH=. python -m pytest -q \
        tests/test_distributed_device_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from distutil import read_jsonl, results, run_ranks

needs_nccl = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_available()
         and torch.distributed.is_nccl_available()), reason="needs a CUDA GPU with NCCL")


def _ok(out, run, label, world):
    assert not run["hung"], f"ranks {run['hung']} hung"
    res = results(out, label, world=world)
    for r, x in enumerate(res):
        assert x is not None and x["ok"], f"rank {r} in {label}: {x and x.get('error')}"
    return res


def _read_later(x):
    during = [(b, r) for b, r, closing in x["reads"] if not closing]
    assert during and all(r > b for b, r in during), x["reads"]


@needs_nccl
def test_one_gpu_nccl_device_path_without_host_syncs(tmp_path):
    run = run_ranks(tmp_path, [("one", "device_reads_later",
                                {"device": "cuda", "sync_debug": True, "ddp": False})],
                    world=1, timeout=180, backend="nccl", pg_timeout=60)
    (r0,) = _ok(tmp_path, run, "one", 1)
    assert r0["path"] == "device" and r0["device"].startswith("cuda")
    assert not r0["detached"] and r0["frames_seen"] == 7
    _read_later(r0)
    recs = read_jsonl(tmp_path / "one" / "stats.jsonl")
    assert sorted({r["step"] for r in recs}) == list(range(7))
    loss = [r for r in recs if r["tensor"] == "loss"]
    assert len(loss) == 7 and all(r["stats"]["numel"] == 1 and r["merged"] for r in loss)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_ddp_device_path_names_a_flipped_bit(tmp_path):
    run = run_ranks(tmp_path, [("two", "device_reads_later",
                                {"device": "cuda", "sync_debug": True})],
                    world=2, timeout=240, backend="nccl", pg_timeout=60)
    r0, r1 = _ok(tmp_path, run, "two", 2)
    assert r0["path"] == r1["path"] == "device"
    _read_later(r0)
    _read_later(r1)
    div = [a for a in r0["alerts"] if a["detector"] == "divergence"]
    assert [(a["step"], a["rank"], a["module"], a["tensor"]) for a in div] == \
        [(4, 1, "module.0", "weight")], r0["alerts"]
    assert r0["collectives"] == r1["collectives"] and not r0["detached"]
