"""Lightning: the callback on a tiny LightningModule, trained to completion by a real Trainer
(CPU): one frame per optimizer step under gradient accumulation, micro-batches merged into one
row, the loss as Lightning backpropagates it, a NaN weight named, replay of a captured step."""
import json
import logging

import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning.pytorch")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.integrations.lightning import StabilityWatchCallback  # noqa: E402

BATCH, STEPS = 4, 5


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.micro_losses = []     # test-side record of every training_step loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.micro_losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def build_model():
    torch.manual_seed(0)
    return Tiny()


def loader(n):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=None)


class NaNWeight(L.Callback):
    """Puts a NaN into net.2's weight at the start of optimizer step `at`."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.net[2].weight[0, 0] = float("nan")


def trainer_for(tmp_path, callbacks, steps=STEPS, accumulate=1, **kw):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1,
                     accumulate_grad_batches=accumulate, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=callbacks, **kw)


def stats(run_dir):
    out = {}
    for line in open(run_dir / "stats.jsonl"):
        r = json.loads(line)
        key = (r["step"], r["module"], r["tensor"])
        assert key not in out, f"{key} written twice"
        out[key] = r["stats"]
    return out


def test_accumulation_one_frame_per_optimizer_step(tmp_path):
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    model = build_model()
    trainer = trainer_for(tmp_path, [cb], accumulate=2)
    trainer.fit(model, loader(2 * STEPS))
    assert trainer.global_step == STEPS
    assert cb.monitor.closed and cb.monitor.frames_seen == STEPS
    recs = stats(tmp_path / "sw")
    assert sorted(s for s, m, t in recs if (m, t) == ("", "loss")) == list(range(STEPS))
    for step in range(STEPS):
        # both micro-batches in one row: the first layer's output holds 2 x BATCH x 16 values
        assert recs[(step, "net.0", "output")]["numel"] == 2 * BATCH * 16
        # the batch: each micro-batch's tensors, named as replay names them
        assert recs[(step, "", "input.1.0")]["numel"] == BATCH * 8
        assert recs[(step, "", "input.1.1")]["numel"] == BATCH
        # the step's loss: the mean of its two micro-batch losses (what Lightning backpropagates)
        pair = model.micro_losses[2 * step: 2 * step + 2]
        assert recs[(step, "", "loss")]["mean"] == pytest.approx(sum(pair) / 2, rel=1e-6)
        # gradients after the whole accumulation, read once per step
        assert recs[(step, "net.0", "grad")]["numel"] == 16 * 8
    assert not [a for a in cb.monitor.alerts if a.severity != sw.Severity.INFO]


def test_gradients_read_after_the_closure(tmp_path):
    """Lightning runs the backward inside optimizer.step(closure): the rows hold the gradient
    the optimizer applies, not the (absent) one before the closure."""
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    grads = {}

    class Keep(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads[trainer.global_step] = pl_module.net[0].weight.grad.abs().max().item()

    model = build_model()
    trainer = trainer_for(tmp_path, [Keep(), cb], steps=3)
    trainer.fit(model, loader(3))
    recs = stats(tmp_path / "sw")
    for step in range(3):
        assert recs[(step, "net.0", "grad")]["absmax"] == pytest.approx(grads[step], rel=1e-6)


def test_nan_weight_is_named_and_replayed(tmp_path):
    # a weight write, whose step is not skipped: the "sampled" snapshots keep its state
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",),
                                                 capture={"snapshot": "sampled"}),
                                run_dir=tmp_path / "sw",
                                model_factory="tests.test_integrations_lightning:build_model")
    model = build_model()
    trainer = trainer_for(tmp_path, [NaNWeight(3), cb], accumulate=2)
    trainer.fit(model, loader(2 * STEPS))
    assert trainer.global_step == STEPS
    crit = [a for a in cb.monitor.alerts if a.severity == sw.Severity.CRITICAL]
    assert crit, cb.monitor.alerts
    first = crit[0]
    assert (first.step, first.detector, first.module, first.tensor) == \
        (3, "nonfinite", "net.2", "weight")
    assert first.capture is not None
    # the capture holds both micro-batches; replay re-runs the step with the default step_fn
    # the bundle records both functions; replay runs those the user names
    manifest = json.loads((tmp_path / "sw" / first.capture / "manifest.json").read_text())
    assert (manifest["model_factory"], manifest["step_fn"]) == \
        ("tests.test_integrations_lightning:build_model", "stabilitywatch.integrations.lightning:replay_step")
    report = sw.replay(tmp_path / "sw" / first.capture, model_factory=manifest["model_factory"],
                       step_fn=manifest["step_fn"], progress=False)
    assert report["reproduces"] is True
    assert report["step"] == 3


def test_bad_arguments_are_refused_where_they_enter():
    with pytest.raises(TypeError, match="config"):
        StabilityWatchCallback(config={"every": 1})
    with pytest.raises(ValueError, match="model_factory"):
        StabilityWatchCallback(model_factory="no_colon")


def test_pytorch_lightning_variant_is_its_callback():
    pl = pytest.importorskip("pytorch_lightning")
    from stabilitywatch.integrations.pytorch_lightning import StabilityWatchCallback as PLCb
    assert issubclass(PLCb, pl.Callback)
    assert issubclass(StabilityWatchCallback, L.Callback)


def test_a_failing_monitor_does_not_stop_training(tmp_path, caplog, monkeypatch):
    from stabilitywatch.integrations import steps

    def broken(self, step, batch=None):
        raise RuntimeError("broken on purpose")
    monkeypatch.setattr(steps.AccumulatedStep, "micro_batch", broken)
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    model = build_model()
    trainer = trainer_for(tmp_path, [cb], steps=3)
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        trainer.fit(model, loader(3))
    assert trainer.global_step == 3
    msgs = [r.getMessage() for r in caplog.records if "broken on purpose" in r.getMessage()]
    assert len(msgs) == 1 and "on_train_batch_start" in msgs[0], msgs


def test_wandb_through_the_trainers_logger(tmp_path, monkeypatch):
    """With a WandbLogger the monitor logs into the logger's run: one run, holding both the
    user's metric and the monitor's per-module charts. (~15 s: wandb's offline service.)"""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger
    from tests.wandb_reader import find_run_files, history_rows, read_finished_run
    monkeypatch.setenv("WANDB_MODE", "offline")

    class Logged(Tiny):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

    torch.manual_seed(0)
    model = Logged()
    logger = WandbLogger(project="sw-test", save_dir=str(tmp_path / "wl"), offline=True)
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, max_epochs=1, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[cb])
    try:
        trainer.fit(model, loader(3))
        assert "wandb" in cb.monitor.config.sinks.use
    finally:
        wandb.finish()
    runs = find_run_files(str(tmp_path / "wl")) + find_run_files(str(tmp_path / "sw"))
    assert len(runs) == 1, runs
    keys = {k for row in history_rows(read_finished_run(runs[0])) for k in row}
    assert "train_loss" in keys
    assert any("net.0" in k for k in keys), sorted(keys)[:20]


@pytest.mark.slow
def test_ddp_ranks(tmp_path):
    """Two CPU processes (ddp_spawn, gloo): every rank runs the callback, the monitor takes the
    trainer's global rank, rank 0 writes the merged rows of every step. (~45 s on a 2-core
    machine: two processes each importing torch and lightning.)"""
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=3,
                        max_epochs=1, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[cb])
    trainer.fit(build_model(), loader(12))
    run_dir = tmp_path / "sw"
    assert json.loads((run_dir / "run.rank1.json").read_text())["rank"] == 1
    recs = [json.loads(line) for line in open(run_dir / "stats.jsonl")]
    assert {(r["rank"], r["world_size"], r["merged"]) for r in recs} == {(0, 2, True)}
    assert sorted({r["step"] for r in recs}) == [0, 1, 2]
    # each rank's two micro-batches, merged over both ranks
    out = [r for r in recs if (r["step"], r["module"], r["tensor"]) == (1, "net.0", "output")]
    assert out and out[0]["stats"]["numel"] == 2 * 2 * BATCH * 16


def test_no_host_sync_in_the_callback(tmp_path, monkeypatch):
    """Under accumulation, every callback event and the monitor's hooks run without a host
    sync from stabilitywatch's code (tests/syncguard.py); Lightning's own code may sync."""
    from tests.syncguard import no_host_sync
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",), capture=()),
                                run_dir=tmp_path / "sw")
    trainer = trainer_for(tmp_path, [cb], steps=3, accumulate=2)
    model = build_model()
    model.micro_losses = None           # the test-side float(loss) would be fine, but skip it

    def training_step(batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(model.net(x), y)
    model.training_step = training_step
    with no_host_sync(monkeypatch) as calls:
        trainer.fit(model, loader(6))
    assert not calls and not cb._failed
    assert cb.monitor.frames_seen == 3


class NaNGrad(L.Callback):
    """Writes a NaN into net.0's weight gradient after the backward of optimizer step `at`, and
    keeps the weight before and after every optimizer step."""

    def __init__(self, at):
        self.at, self.before, self.after = at, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            pl_module.net[0].weight.grad[0, 0] = float("nan")
        self.before[trainer.global_step] = pl_module.net[0].weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = pl_module.net[0].weight.detach().clone()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_sentinel_and_guard_after_the_closure(tmp_path, fused):
    """The backward runs inside optimizer.step(closure), after the optimizer's pre-step hook:
    the sentinel and the guard run when the callback reads the gradients, so a NaN gradient on
    an unsampled step is named at that step and the guard skips it."""
    cb = StabilityWatchCallback(config=sw.Config(every=10, warmup=0, sinks=("jsonl",),
                                                 guard={"on_nonfinite": "skip"}, capture=()),
                                run_dir=tmp_path / "sw")
    inject = NaNGrad(3)

    class Model(Tiny):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused)

    torch.manual_seed(0)
    trainer = trainer_for(tmp_path, [inject, cb], steps=6)
    trainer.fit(Model(), loader(6))
    crit = [a for a in cb.monitor.alerts if a.severity == sw.Severity.CRITICAL]
    assert crit, cb.monitor.alerts
    assert (crit[0].step, crit[0].module, crit[0].tensor) == (3, "net.0", "grad")
    assert crit[0].extra.get("skipped") is True
    assert torch.equal(inject.before[3], inject.after[3])          # step 3 moved nothing
    assert not torch.equal(inject.before[4], inject.after[4])      # step 4 trained
    assert torch.isfinite(inject.after[5]).all()


class ScaleWeight(L.Callback):
    """Multiplies net.2's weight by 1e4 at the start of optimizer step `at` (a write no
    optimizer makes: the physics check names it, critically, and the step is captured)."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and batch_idx % trainer.accumulate_grad_batches == 0:
            with torch.no_grad():
                pl_module.net[2].weight.mul_(1e4)


def test_short_last_group_replays_with_lightnings_divisor(tmp_path):
    # 6 micro-batches, 4 per step: step 1 is the epoch's short last group of 2, whose losses
    # Lightning still divides by 4; its capture replays only with that divisor
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",),
                                                 capture={"snapshot": "sampled"}),
                                run_dir=tmp_path / "sw",
                                model_factory="tests.test_integrations_lightning:build_model")
    model = build_model()
    trainer = trainer_for(tmp_path, [ScaleWeight(1), cb], steps=2, accumulate=4)
    trainer.fit(model, loader(6))
    assert trainer.global_step == 2
    recs = stats(tmp_path / "sw")
    # the loss row of the short step: its two micro-batch losses, each divided by 4
    assert recs[(1, "", "loss")]["mean"] == pytest.approx(sum(model.micro_losses[4:6]) / 4,
                                                          rel=1e-6)
    crit = [a for a in cb.monitor.alerts if a.severity == sw.Severity.CRITICAL and a.step == 1
            and a.capture is not None]
    assert crit, cb.monitor.alerts
    bundle = tmp_path / "sw" / crit[0].capture
    report = sw.replay(bundle, model_factory="tests.test_integrations_lightning:build_model",
                       step_fn="stabilitywatch.integrations.lightning:replay_step",
                       progress=False)
    assert report["step"] == 1
    assert report["reproduces"] is True, report.get("verdict")
