"""HF transformers: the callback on a real `Trainer` training a tiny GPT-2 (CPU): one frame per
optimizer step under gradient accumulation, micro-batches merged, the loss the trainer logs, a
NaN weight named, replay of a captured step; Accelerate's wrapped optimizer."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.integrations.hf import StabilityWatchCallback  # noqa: E402

SEQ, MICRO, STEPS, VOCAB = 8, 2, 4, 64


def build_model():
    torch.manual_seed(0)
    # dropout off: with GPT-2's attention dropout, replay's rows of this step differ from the
    # recorded ones in the last bit of a few attention outputs (the replay verdict, not the
    # callback, is what such a test would then judge)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB,
                                  n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def trainer_for(tmp_path, callbacks, accumulate=2, steps=STEPS):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=accumulate, max_steps=steps, report_to=[], use_cpu=True,
        logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
        dataloader_num_workers=0, seed=0)
    return transformers.Trainer(model=build_model(), args=args,
                                train_dataset=dataset(MICRO * accumulate * steps),
                                callbacks=callbacks)


def stats(run_dir):
    out = {}
    for line in open(run_dir / "stats.jsonl"):
        r = json.loads(line)
        key = (r["step"], r["module"], r["tensor"])
        assert key not in out, f"{key} written twice"
        out[key] = r["stats"]
    return out


class NaNWeight(transformers.TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == self.at:
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")


def test_accumulation_one_frame_per_optimizer_step(tmp_path):
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",)),
                                run_dir=tmp_path / "sw")
    trainer = trainer_for(tmp_path, [cb])
    trainer.train()
    assert trainer.state.global_step == STEPS
    assert cb.monitor.closed and cb.monitor.frames_seen == STEPS
    recs = stats(tmp_path / "sw")
    assert sorted(s for s, m, t in recs if (m, t) == ("", "loss")) == list(range(STEPS))
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS
    for step in range(STEPS):
        # two micro-batches of MICRO x SEQ tokens merged into one row
        assert recs[(step, "transformer.h.0.mlp.c_fc", "output")]["numel"] == \
            2 * MICRO * SEQ * 64
        # the loss row is the loss the trainer logs for that step
        assert recs[(step, "", "loss")]["mean"] == pytest.approx(logged[step], rel=1e-5)
    assert not [a for a in cb.monitor.alerts if a.severity != sw.Severity.INFO]


def test_nan_weight_is_named_and_replayed(tmp_path):
    # a weight write, whose step is not skipped: the "sampled" snapshots keep its state
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",),
                                                 capture={"snapshot": "sampled"}),
                                run_dir=tmp_path / "sw",
                                model_factory="tests.test_integrations_hf:build_model")
    trainer = trainer_for(tmp_path, [NaNWeight(2), cb])
    trainer.train()
    assert trainer.state.global_step == STEPS
    crit = [a for a in cb.monitor.alerts if a.severity == sw.Severity.CRITICAL]
    assert crit, cb.monitor.alerts
    first = crit[0]
    assert (first.step, first.detector, first.module, first.tensor) == \
        (2, "nonfinite", "transformer.h.0.mlp.c_fc", "weight")
    assert first.capture is not None
    # the bundle records both functions; replay runs those the user names
    manifest = json.loads((tmp_path / "sw" / first.capture / "manifest.json").read_text())
    assert (manifest["model_factory"], manifest["step_fn"]) == \
        ("tests.test_integrations_hf:build_model", "stabilitywatch.integrations.hf:replay_step")
    report = sw.replay(tmp_path / "sw" / first.capture, model_factory=manifest["model_factory"],
                       step_fn=manifest["step_fn"], progress=False)
    assert report["step"] == 2
    assert report["reproduces"] is True, report["reproduce"]


def test_bad_arguments_are_refused_where_they_enter():
    with pytest.raises(TypeError, match="config"):
        StabilityWatchCallback(config="every=1")
    with pytest.raises(ValueError, match="step_fn"):
        StabilityWatchCallback(step_fn="nocolon")
    assert issubclass(StabilityWatchCallback, transformers.TrainerCallback)


def test_no_host_sync_in_the_callback(tmp_path, monkeypatch):
    """The callback's events and hooks never sync from stabilitywatch's code (the trainer's own
    code may: tests/syncguard.py)."""
    from tests.syncguard import no_host_sync
    cb = StabilityWatchCallback(config=sw.Config(every=1, sinks=("jsonl",), capture=()),
                                run_dir=tmp_path / "sw")
    trainer = trainer_for(tmp_path, [cb], steps=2)
    with no_host_sync(monkeypatch) as calls:
        trainer.train()
    assert not calls and not cb._failed and cb.monitor.frames_seen == 2
