"""GPU-only: the cost budget times CUDA steps with events it only queries (no host sync), and its
stretched cadence is the one the run samples. Run on a CUDA machine with
STABILITYWATCH_REAL_TRITON=1."""
import json

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.pacing import MAX_FACTOR

from test_monitor_gpu import train_without_syncs
from test_pacing import expected_sampled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_events_stretch_the_cadence_without_a_sync(tmp_path):
    # a budget no sampled step fits: the pacer goes to its widest cadence from the events alone
    config = sw.Config(every=4, warmup=4, cost_budget=1e-6, escalate_steps=0)
    steps = 80
    mon = train_without_syncs(tmp_path, config, steps=steps)
    assert mon.pacer.on and mon.pacer.factor == MAX_FACTOR
    cadence = json.loads((tmp_path / "run.json").read_text())["cadence"]
    assert cadence and cadence[-1]["every"] == 4 * MAX_FACTOR
    assert all(c["step_ms"] > 0 and c["sampled_extra_ms"] > 0 for c in cadence)
    rows = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    sampled = {r["step"] for r in rows if r["tensor"] == "output"}
    assert sampled == expected_sampled(steps, cadence, every=4, warmup=4)
