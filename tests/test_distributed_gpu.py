"""2 GPUs, NCCL: the distributed scenarios of test_distributed.py and test_distributed_gpt2.py
on CUDA (DDP with a flipped bit through both flush paths, real FSDP2, a tiny GPT-2 under DDP
and FSDP2 with a NaN in one rank's gradient shard and a flipped exponent bit). Skipped without 2 CUDA devices. Run on the GPU
machine with STABILITYWATCH_REAL_TRITON=1 (the Triton kernel, not the interpreter):

    STABILITYWATCH_REAL_TRITON=1 PYTHONPATH=. python -m pytest -q tests/test_distributed_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from distutil import read_jsonl, results, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

SCENARIOS = [
    ("ddp_gloo", "ddp_bitflip", {"device": "cuda", "dist_backend": "gloo"}),
    ("ddp_nccl", "ddp_bitflip", {"device": "cuda", "dist_backend": "default"}),
    ("fsdp2", "fsdp2", {"device": "cuda"}),
    ("nan_ddp", "gpt2_nan", {"wrap": "ddp", "device": "cuda"}),
    ("nan_fsdp2", "gpt2_nan", {"wrap": "fsdp2", "device": "cuda"}),
    ("flip_ddp", "gpt2_bitflip", {"wrap": "ddp", "device": "cuda"}),
    ("flip_fsdp2", "gpt2_bitflip", {"wrap": "fsdp2", "device": "cuda"}),
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_gpu")
    return out, run_ranks(out, SCENARIOS, world=2, timeout=240, backend="nccl", pg_timeout=60)


def _ok(out, run, label):
    assert not run["hung"], f"ranks {run['hung']} hung"
    res = results(out, label)
    for r, x in enumerate(res):
        assert x is not None and x["ok"], f"rank {r} in {label}: {x and x.get('error')}"
    return res


@pytest.mark.parametrize("label", ["ddp_gloo", "ddp_nccl"])
def test_ddp_bit_flip_on_gpus(spawned, label):
    out, run = spawned
    r0, r1 = _ok(out, run, label)
    div = [a for a in r0["alerts"] if a["detector"] == "divergence"]
    assert [(a["step"], a["rank"], a["module"], a["tensor"]) for a in div] == \
        [(4, 1, "module.0", "weight")], r0["alerts"]
    assert r0["collectives"] == r1["collectives"] and not r0["detached"]
    recs = read_jsonl(out / label / "stats.jsonl")
    loss = [r for r in recs if r["tensor"] == "loss"]
    assert len(loss) == 8 and all(r["stats"]["numel"] == 2 for r in loss)


def test_fsdp2_on_gpus(spawned):
    out, run = spawned
    r0, _ = _ok(out, run, "fsdp2")
    assert r0["compared"] == 48 and r0["mismatch"] == {}, r0["mismatch"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_gpt2_nan_in_one_ranks_shard_on_gpus(spawned, wrap):
    out, run = spawned
    r0, r1 = _ok(out, run, f"nan_{wrap}")
    assert r0["unchanged_at_nan"] and r1["unchanged_at_nan"] and r0["finite"]
    if wrap == "ddp":
        assert r0["digest"] == r1["digest"]
    nf = [a for a in r0["alerts"] if a["detector"] == "nonfinite" and a["step"] == 5]
    assert nf and (nf[0]["rank"], nf[0]["module"], nf[0]["tensor"]) == (1, r0["module"], "grad")
    if wrap == "fsdp2":
        assert nf[0]["extra"]["shard"]["rows"] == [16, 32]


@pytest.mark.parametrize("wrap,detector", [("ddp", "divergence"), ("fsdp2", "physics")])
def test_gpt2_flipped_bit_on_gpus(spawned, wrap, detector):
    out, run = spawned
    r0, _ = _ok(out, run, f"flip_{wrap}")
    hit = [a for a in r0["alerts"] if a["detector"] == detector
           and (a["module"], a["tensor"]) == (r0["module"], "weight")]
    assert hit and hit[0]["step"] == 3 and hit[0]["rank"] == 1, r0["alerts"]
