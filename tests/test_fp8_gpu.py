"""GPU: FP8 linear layers running real torch._scaled_mm (E4M3 forward, E5M2 backward), watched
without host syncs, matching the CPU emulation."""
import json

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.integrations.fp8 import Fp8Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make():
    torch.manual_seed(0)
    return nn.Sequential(Fp8Linear(64, 128, margin=1), nn.GELU(), Fp8Linear(128, 64, margin=1))


def test_scaled_mm_matches_emulation():
    cpu, gpu = make(), make().cuda()
    x = torch.randn(32, 64)
    y_cpu = cpu(x)
    y_gpu = gpu(x.cuda().to(torch.bfloat16)).float().cpu()
    rel = ((y_gpu - y_cpu).norm() / y_cpu.norm()).item()
    assert rel < 0.05, rel


def test_fp8_model_watched_without_sync(tmp_path):
    model = make().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [torch.randn(32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    cfg = sw.Config(every=1, sinks=("jsonl",), formats={"fp8.input": "e4m3", "fp8.weight": "e4m3",
                                                         "fp8.grad_output": "e5m2"})
    mon = sw.watch(model, opt, config=cfg, run_dir=tmp_path)

    def train(steps):
        for step in steps:
            with mon.step(step):
                loss = model(xs[step]).float().square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)

    train(range(2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train(range(2, 5))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    mon.close()
    recs = {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(tmp_path / "stats.jsonl"))}
    assert recs[(4, "2", "fp8.grad_output.e5m2")]["numel"] == 32 * 64
    assert recs[(4, "0", "fp8.input")]["e4m3_headroom_bits"] > 0
