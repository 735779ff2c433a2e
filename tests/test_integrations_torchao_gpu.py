"""GPU: torchao float8 training on real float8 matmuls (no emulation), bf16, eager and
torch.compile (inductor), watched without host syncs; the counts are those of torchao's own
casts (read back from its float8 tensors)."""
import json

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with float8 matmuls (compute capability 8.9 or newer)")

ao_float8 = pytest.importorskip("torchao.float8")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.integrations import torchao as swao  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import float8_linear as ao_linear  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402


def model(recipe=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(), nn.Linear(512, 256, bias=False))
    m = m.cuda().to(torch.bfloat16)
    cfg = Float8LinearConfig.from_recipe_name(recipe) if recipe else Float8LinearConfig()
    return convert_to_float8_training(m, config=cfg)


def crafted():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 1e-3
    x[0, 0] = 1e4
    return x


def read(run_dir):
    return {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(run_dir / "stats.jsonl"))}


@pytest.mark.parametrize("recipe", [None, "rowwise"], ids=["tensorwise", "rowwise"])
def test_counts_are_torchaos_casts(tmp_path, monkeypatch, recipe):
    seen = []
    real = ao_linear.hp_tensor_to_float8_dynamic

    def spy(hp, *a, **kw):
        out = real(hp, *a, **kw)
        seen.append((kw.get("gemm_input_role"), kw.get("axiswise_dim"), hp.detach().clone(),
                     out._data.clone(), out._scale.clone()))
        return out
    monkeypatch.setattr(ao_linear, "hp_tensor_to_float8_dynamic", spy)
    m = model(recipe)
    x = crafted()
    with swao.watch_float8(m, config=sw.Config(every=1, sinks=("jsonl",)),
                           run_dir=tmp_path) as mon:
        with mon.step(0):
            m(x).float().square().mean().backward()
    recs = read(tmp_path)
    role, axis, hp, data, scale = next(s for s in seen if s[0] == GemmInputRole.INPUT)
    flushed = int(((hp != 0) & (data.float() == 0)).sum())
    assert recs[(0, "0", "fp8.input")]["e4m3_underflow"] == flushed
    assert recs[(0, "0", "fp8.input")]["e4m3_overflow"] == 0
    if recipe is None:     # one scale for the tensor: the outlier flushes nearly all of it
        assert recs[(0, "0", "fp8.scale.input")]["absmax"] == float(scale)
        assert flushed > 0.9 * x.numel()
        assert any(a.detector == "underflow" and a.tensor == "fp8.input" for a in mon.alerts)
    else:                  # one scale per row: only the outlier's row flushes
        assert 0 < flushed < x.shape[1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_watched_without_sync(tmp_path, compiled):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    run = torch.compile(m) if compiled else m
    xs = [torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    mon = swao.watch_float8(m, opt, config=sw.Config(every=2, warmup=0, sinks=("jsonl",)),
                            run_dir=tmp_path)

    def steps(rng):
        for step in rng:
            with mon.step(step):
                loss = run(xs[step]).float().square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    steps(range(2))                       # compiles and creates the rows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps(range(2, 6))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    mon.close()
    recs = read(tmp_path)
    for step in (2, 4):
        for role in ("fp8.input", "fp8.weight", "fp8.grad_output"):
            assert (step, "2", role) in recs, (step, role)
        assert recs[(step, "2", "fp8.input")]["e4m3_headroom_bits"] == pytest.approx(0, abs=1e-5)
    assert not [a for a in mon.alerts if a.severity != sw.Severity.INFO]
