"""torchao float8 training, watched at its casts (CPU, torchao's emulation): the scale the
monitor records is the one torchao's cast used (read back from torchao's own float8 tensors),
and the underflow/overflow counts are those of torchao's cast at that scale."""
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

ao_float8 = pytest.importorskip("torchao.float8")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.integrations import torchao as swao  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import float8_linear as ao_linear  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402

E4M3, E5M2 = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max


@pytest.fixture
def casts(monkeypatch):
    """Every cast torchao's Float8Linear makes: (gemm role, axiswise dim, hp, fp8 data, scale)."""
    seen = []
    real = ao_linear.hp_tensor_to_float8_dynamic

    def spy(hp, *args, **kwargs):
        out = real(hp, *args, **kwargs)
        seen.append((kwargs.get("gemm_input_role"), kwargs.get("axiswise_dim"),
                     hp.detach().clone(), out._data.clone(), out._scale.clone()))
        return out
    monkeypatch.setattr(ao_linear, "hp_tensor_to_float8_dynamic", spy)
    return seen


def converted(config=None, n_in=32, n_out=16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(n_in, n_out, bias=False))
    return convert_to_float8_training(model, config=config or Float8LinearConfig(emulate=True))


def crafted(n_in=32, rows=16):
    # one outlier sets the current scale; values 1e7 times smaller flush to zero in E4M3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n_in, generator=g) * 1e-3
    x[0, 0] = 1e4
    return x


def crafted_grad(rows=16, n_out=16):
    g = torch.Generator().manual_seed(4)
    go = torch.randn(rows, n_out, generator=g) * 1e-7
    go[1, 2] = 1e4
    return go


def run(model, tmp_path, x, go, config=None, steps=1):
    cfg = config or sw.Config(every=1, sinks=("jsonl",))
    with swao.watch_float8(model, config=cfg, run_dir=tmp_path) as mon:
        for step in range(steps):
            with mon.step(step):
                out = model(x)
                (out * go).sum().backward()      # the output's gradient is exactly `go`
    recs = {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(tmp_path / "stats.jsonl"))}
    return mon, recs


def flushed(hp, data):
    return int(((hp != 0) & (data.float() == 0)).sum())


def test_tensorwise_counts_and_scales_are_torchaos(tmp_path, casts):
    model = converted()
    x, go = crafted(), crafted_grad()
    mon, recs = run(model, tmp_path, x, go)
    by_role = {}
    for role, axis, hp, data, scale in casts:
        by_role.setdefault(role, (hp, data, scale))   # the first cast of each role
    for role, name, fmt, fmax in ((GemmInputRole.INPUT, "input", "e4m3", E4M3),
                                  (GemmInputRole.WEIGHT, "weight", "e4m3", E4M3),
                                  (GemmInputRole.GRAD_OUTPUT, "grad_output", "e5m2", E5M2)):
        hp, data, scale = by_role[role]
        row = recs[(0, "0", f"fp8.{name}")]
        # the scale torchao's cast multiplied by, bit for bit
        assert recs[(0, "0", f"fp8.scale.{name}")]["absmax"] == float(scale), name
        assert row["absmax"] == float(hp.abs().max())
        # what torchao's cast flushed to zero; nothing saturates under current scaling
        assert row[f"{fmt}_underflow"] == flushed(hp, data), name
        assert row[f"{fmt}_overflow"] == 0
        assert row["numel"] == hp.numel()
    # the crafted input and gradient: most values flush (not a tautology: counted above)
    assert recs[(0, "0", "fp8.input")]["e4m3_underflow"] > 0.9 * x.numel()
    assert recs[(0, "0", "fp8.grad_output")]["e5m2_underflow"] > 0.9 * go.numel()
    crit = {(a.detector, a.module, a.tensor) for a in mon.alerts
            if a.severity == sw.Severity.CRITICAL}
    assert ("underflow", "0", "fp8.input") in crit
    assert ("underflow", "0", "fp8.grad_output") in crit
    assert ("underflow", "0", "fp8.weight") not in crit


def test_a_clean_run_stays_quiet(tmp_path):
    """Many casts of ordinary data: no overflow or underflow alert (current scaling's rounding
    of the amax just above the max, which happens in about one cast in ten, is not one)."""
    torch.manual_seed(0)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)),
        config=Float8LinearConfig(emulate=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    cfg = sw.Config(every=1, sinks=("jsonl",))
    with swao.watch_float8(model, opt, config=cfg, run_dir=tmp_path) as mon:
        for step in range(12):
            with mon.step(step):
                x = torch.randn(16, 32, generator=g)
                (model(x) * torch.randn(16, 16, generator=g)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert not [a.line() for a in mon.alerts if a.severity != sw.Severity.INFO]
    recs = {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(tmp_path / "stats.jsonl"))}
    assert recs[(11, "2", "fp8.input")]["e4m3_headroom_bits"] == pytest.approx(0, abs=1e-6)


def test_amax_rounded_above_the_max_is_not_a_saturation():
    """Current scaling: fmt_max / amax in float32 can put amax * scale one float32 step above
    the max; the cast writes the max there. The recorded scale keeps it at the max."""
    ao = swao._torchao()
    cast = swao._Cast(ao, Float8LinearConfig(emulate=True), "cast_config_input", -1)
    found = None
    for k in range(1, 2000):            # the first amax where the rounding goes up
        amax = torch.tensor(1.0 + k / 997.0)
        s = ao["utils"].amax_to_scale(amax, torch.float8_e4m3fn)
        if float(amax * s) > E4M3:
            found = amax
            break
    assert found is not None
    hp = torch.tensor([found.item(), 0.5, -0.25])
    used, kept = cast.scale(hp)
    assert torch.equal(used, ao["utils"].tensor_to_scale(hp, torch.float8_e4m3fn))
    assert float(hp[0] * used) > E4M3               # counted as overflow at torchao's scale
    assert float(kept) == float(torch.nextafter(used, torch.zeros_like(used)))
    stats = sw.tensor_stats(hp, scale=float(kept))
    assert stats["e4m3_overflow"] == 0
    # and the cast itself: the amax lands on the max, not clamped from anything larger
    assert float(ao["utils"].to_fp8_saturated(hp.float() * used, torch.float8_e4m3fn)[0]) == E4M3


def test_rowwise_recipe_reads_every_cast(tmp_path, casts):
    cfg = Float8LinearConfig.from_recipe_name("rowwise")
    cfg = dataclasses.replace(cfg, emulate=True)
    model = converted(cfg)
    x, go = crafted(), crafted_grad()
    mon, recs = run(model, tmp_path, x, go)
    for name in ("input", "weight", "grad_output", "input_for_grad_weight",
                 "weight_for_grad_input", "grad_output_for_grad_weight"):
        assert (0, "0", f"fp8.{name}") in recs, name
    # rowwise: the rows hold the scaled values; the input row's flushes are torchao's
    hp, data = next((hp, d) for r, a, hp, d, s in casts if r == GemmInputRole.INPUT and a == -1)
    row = recs[(0, "0", "fp8.input")]
    assert row["e4m3_underflow"] == flushed(hp, data)
    # the casts for the other matmuls, along the other axis: torchao's flushes too
    for role, name, axis in ((GemmInputRole.INPUT, "input_for_grad_weight", 0),
                             (GemmInputRole.GRAD_OUTPUT, "grad_output_for_grad_weight", 0),
                             (GemmInputRole.WEIGHT, "weight_for_grad_input", -1)):
        hp, data = next((h, d) for r, a, h, d, s in casts if r == role and a == axis)
        assert recs[(0, "0", f"fp8.{name}")]["e4m3_underflow"] == flushed(hp, data), name
    # one scale per row of the input: row 0 holds the outlier, the others keep their values
    assert recs[(0, "0", "fp8.scale.input")]["numel"] == x.shape[0]
    assert row["e4m3_underflow"] < x.shape[1]


def test_hooks_removed_at_close(tmp_path):
    model = converted()
    mon = swao.watch_float8(model, config=sw.Config(sinks=("jsonl",)), run_dir=tmp_path)
    n = len(model[0]._forward_hooks)
    mon.close()
    assert len(model[0]._forward_hooks) < n


def test_formats_from_the_layers_and_user_formats_win(tmp_path):
    model = converted()
    mon = swao.watch_float8(model, config=sw.Config(sinks=("jsonl",),
                                                    formats={"fp8.weight": "fp16"}),
                            run_dir=tmp_path)
    mon.close()
    assert mon.config.formats["fp8.input"] == "e4m3"
    assert mon.config.formats["fp8.grad_output"] == "e5m2"
    assert mon.config.formats["fp8.weight"] == "fp16"


def test_model_without_float8_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Float8Linear"):
        swao.watch_float8(nn.Linear(4, 4), run_dir=tmp_path)


def test_compiled_float8_model_is_read(tmp_path):
    """torch.compile (aot_eager): the casts are read on sampled steps, with the numbers of the
    eager run, and not at all on the others."""
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(16, 32, generator=g) for _ in range(3)]
    gos = [torch.randn(16, 16, generator=g) for _ in range(3)]
    recs = {}
    for mode in ("eager", "compiled"):
        model = converted()
        run_model = torch.compile(model, backend="aot_eager") if mode == "compiled" else model
        cfg = sw.Config(every=2, warmup=0, sinks=("jsonl",))
        with swao.watch_float8(model, config=cfg, run_dir=tmp_path / mode) as mon:
            for step in range(3):
                with mon.step(step):
                    (run_model(xs[step]) * gos[step]).sum().backward()
        assert not [a.line() for a in mon.alerts if a.severity != sw.Severity.INFO]
        recs[mode] = {(r["step"], r["module"], r["tensor"]): r["stats"]
                      for r in map(json.loads, open(tmp_path / mode / "stats.jsonl"))}
    for step in (0, 2):
        for role in ("fp8.input", "fp8.weight", "fp8.grad_output", "fp8.scale.input"):
            a, b = recs["eager"][(step, "0", role)], recs["compiled"][(step, "0", role)]
            assert a["absmax"] == b["absmax"] and a["numel"] == b["numel"], (step, role)
            for k in ("e4m3_underflow", "e5m2_underflow", "e4m3_overflow", "e5m2_overflow"):
                assert a[k] == b[k], (step, role, k)
    assert (1, "0", "fp8.input") not in recs["compiled"]


def test_no_host_sync(tmp_path, monkeypatch):
    """The casts' reads never wait for the device: no item()/bool()/... from stabilitywatch's
    code inside the steps (caught on the CPU, tests/syncguard.py)."""
    from tests.syncguard import no_host_sync
    model = converted()
    x, go = crafted(), crafted_grad()
    mon = swao.watch_float8(model, config=sw.Config(every=1, sinks=("jsonl",)),
                            run_dir=tmp_path)
    for step in range(3):
        with no_host_sync(monkeypatch) as calls:
            with mon.step(step):
                (model(x) * go).sum().backward()
                mon.observe_loss(x.sum())
        assert not calls
    mon.close()
    assert not mon.taps._failed and mon.frames_seen == 3
    assert {a.tensor for a in mon.alerts if a.detector == "underflow"} >= {"fp8.input"}


def test_trainer_callback_reads_the_casts_by_itself(tmp_path):
    """A torchao float8 model under the Lightning callback: the casts are read, formats set."""
    L = pytest.importorskip("lightning.pytorch")
    from stabilitywatch.integrations.lightning import StabilityWatchCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = convert_to_float8_training(nn.Sequential(nn.Linear(32, 16)),
                                                  config=Float8LinearConfig(emulate=True))

        def training_step(self, batch, batch_idx):
            return (self.net(batch) * crafted_grad()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[cb])
    data = torch.utils.data.DataLoader([crafted(), crafted()], batch_size=None)
    trainer.fit(Module(), data)
    assert cb.monitor.config.formats["fp8.grad_output"] == "e5m2"
    recs = {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(tmp_path / "sw" / "stats.jsonl"))}
    assert recs[(1, "net.0", "fp8.input")]["e4m3_underflow"] > 0.9 * crafted().numel()
    assert (1, "net.0", "fp8.grad_output") in recs
