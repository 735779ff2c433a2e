"""GPU-only: the cost budget times CUDA steps with events it only queries (no host sync), and its
stretched cadence is the one the run samples. Run on a CUDA machine with
STABILITYWATCH_REAL_TRITON=1."""
import json

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.demo import build_model, make_batch, train_step
from stabilitywatch.pacing import MAX_FACTOR

from test_pacing import expected_sampled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_events_stretch_the_cadence_without_a_sync(tmp_path):
    # a budget no sampled step fits: the pacer goes to its widest cadence from the events alone
    config = sw.Config(every=4, warmup=4, cost_budget=1e-6, escalate_steps=0)
    model = build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)
    steps = 80
    data = [make_batch(gen, "cuda") for _ in range(steps)]
    mon = sw.watch(model, opt, config=config, run_dir=tmp_path)
    try:
        for step in range(steps):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            with mon.step(step, batch=data[step]):
                loss = train_step(model, data[step])
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    mon.close()
    assert mon.pacer.on and mon.pacer.factor == MAX_FACTOR
    cadence = json.loads((tmp_path / "run.json").read_text())["cadence"]
    assert cadence and cadence[-1]["every"] == 4 * MAX_FACTOR
    assert all(c["step_ms"] > 0 and c["sampled_extra_ms"] > 0 for c in cadence)
    rows = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    sampled = {r["step"] for r in rows if r["tensor"] == "output"}
    assert sampled == expected_sampled(steps, cadence, every=4, warmup=4)
