"""A bundle for every critical incident, sampled step or not, at the default policy's cost:
with the guard, the skipped step's state (held by the guard's latch) copied once; without it, a
bundle that says what it lacks; the default copies no weights per step."""
import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.capture.reader import CaptureError, open_capture
from stabilitywatch.capture.state import state_nbytes
from stabilitywatch.guard import HOLD_LIMIT, Guard

import capture_models as cm

REPLAY = {"model_factory": "capture_models:build", "step_fn": "capture_models:step_fp16",
          "progress": False}


def unsampled(**kw):
    # every=10, no warm-up: the fault at step 3 falls on an unsampled step
    return sw.Config(**{"every": 10, "warmup": 0, "sinks": ("jsonl",), **kw})


def _start_of(step_no, seen):
    def before(step, model, opt, batch):
        if step == step_no:
            seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            seen["exp_avg"] = opt.state[model.fc2.weight]["exp_avg"].clone()
    return before


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "host-fallback"])
def test_guard_on_an_unsampled_step_writes_a_bundle_that_reproduces(tmp_path, fused,
                                                                    monkeypatch, capsys):
    if fused:   # the guard's device path (found_inf); cm.train builds a plain AdamW
        orig = torch.optim.AdamW
        monkeypatch.setattr(torch.optim, "AdamW", lambda ps, **k: orig(ps, fused=True, **k))
    seen: dict = {}
    mon, model, _ = cm.train(tmp_path / "run", steps=6, config=unsampled(guard={"on_nonfinite": "skip"}),
                             before_step=_start_of(3, seen))
    assert bool(mon.control.guard.fused) is fused
    root = next(a for a in mon.alerts if a.step == 3 and a.root)
    assert root.severity is sw.Severity.CRITICAL and not root.extra["sampled"]
    assert root.capture == "captures/step00000003-rank0"
    assert root.extra["capture_lacks"] == [] and root.extra["held_steps"] == 1
    assert "the guard held the weights for its bundle: 1 step skipped" in root.message
    bundle = tmp_path / "run" / root.capture
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["lacks"] == [] and m["held"] == {"first": 3, "last": 3, "skipped_steps": 1}
    from stabilitywatch.cli import main
    assert main(["inspect", str(bundle)]) == 0
    assert "state: held by the guard, 1 step(s) skipped (3..3)" in capsys.readouterr().out
    cap = open_capture(bundle)
    for k, v in seen["model"].items():   # the state step 3 started from, though read after it
        assert torch.equal(cap.tensors("model")[k], v), k
    assert torch.equal(cap.tensors("optimizer")["2.exp_avg"], seen["exp_avg"])
    monkeypatch.undo()   # replay looks the optimizer class up in torch.optim
    r = sw.replay(bundle, **REPLAY)
    assert r["reproduces"] is True and r["verdict"]["kind"] == "numerics"
    assert r["first_divergent_module"] == "fc2"


def test_without_the_guard_the_bundle_says_what_it_lacks(tmp_path, capsys):
    mon, _, _ = cm.train(tmp_path / "run", steps=6, config=unsampled())
    root = next(a for a in mon.alerts if a.step == 3 and a.root)
    assert root.capture == "captures/step00000003-rank0"
    assert root.extra["capture_lacks"] == ["model", "optimizer"]
    assert ("its bundle lacks the start-of-step weights and optimizer state (it holds the batch, "
            "RNG states and the rows)") in root.message
    bundle = tmp_path / "run" / root.capture
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["lacks"] == ["model", "optimizer"] and "the guard is off" in m["lacks_why"]
    cap = open_capture(bundle)
    assert cap.tensors("model") == {} and cap.tensors("optimizer") == {}
    assert set(cap.tensors("batch")) == {"batch.x", "batch.y", "batch.meta.ids"} and "torch" in cap.tensors("rng")
    from stabilitywatch.cli import main
    assert main(["inspect", str(bundle)]) == 0
    assert "written without: model, optimizer (replay runs without them and says so): the " \
        "step's update was applied" in capsys.readouterr().out
    r = sw.replay(bundle, **REPLAY)
    v = r["verdict"]
    assert r["reproduces"] is False and v["kind"] == "lacks"
    assert v["lacks"] == ["model state", "optimizer state"] and "the guard is off" in v["text"]


def test_the_default_policy_copies_no_weights_per_step(tmp_path):
    """every=1 (every step sampled), a clean run: no weight copy, no snapshot ring; with the
    guard and a NaN step: one copy, of exactly the weights and optimizer state, for its bundle."""
    held = []
    mon, model, opt = cm.train(tmp_path / "clean", steps=5, fault_step=-1,
                               config=sw.Config(every=1, sinks=("jsonl",)),
                               during_step=lambda mon, step, m: held.append(
                                   mon.capture.snap.nbytes))
    assert held == [0] * 5 and mon.capture.copies == [] and mon.capture.snapshot_bytes == 0
    # the "sampled" policy, for comparison: a copy of everything on each of the 5 steps
    mon, model, opt = cm.train(tmp_path / "sampled", steps=5, fault_step=-1,
                               config=sw.Config(every=1, sinks=("jsonl",),
                                                capture={"snapshot": "sampled"}))
    names = {id(p): n for n, p in model.named_parameters()}
    assert mon.capture.snapshot_bytes >= 4 * state_nbytes(model, opt, names)
    mon, model, opt = cm.train(tmp_path / "guard", steps=5,
                               config=sw.Config(every=1, sinks=("jsonl",), guard={"on_nonfinite": "skip"}))
    names = {id(p): n for n, p in model.named_parameters()}
    assert mon.capture.copies == [(3, state_nbytes(model, opt, names))]
    assert mon.capture.snapshot_bytes == 0


def test_the_bundle_records_the_escalated_steps_rows(tmp_path):
    mon, _, _ = cm.train(tmp_path / "run", steps=8,
                         config=unsampled(guard={"on_nonfinite": "skip"}, escalate_steps=3))
    cap = open_capture(tmp_path / "run/captures/step00000003-rank0")
    frames = cap.escalated()
    assert [f["step"] for f in frames] == [4, 5, 6]
    keys = {tuple(k) for k in frames[0]["keys"]}
    assert ("fc2", "output") in keys and ("fc2", "weight") in keys   # every role: escalated
    assert all(len(f["rows"]) == len(f["keys"]) for f in frames)
    (cap.path / "escalated.json").write_text((cap.path / "escalated.json").read_text()
                                             .replace('"step": 5', '"step": 9'))
    with pytest.raises(CaptureError, match="checksum mismatch for escalated.json"):
        open_capture(cap.path).escalated()


def test_state_over_the_budget_is_left_out_and_said(tmp_path):
    class Big(nn.Module):   # a large buffer: the state does not fit capture_max_bytes
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.register_buffer("table", torch.zeros(1 << 18))

        def forward(self, x):
            return self.fc(x)

    model = Big()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = unsampled(guard={"on_nonfinite": "skip"}, capture={"max_bytes": 512 << 10})
    with sw.watch(model, opt, config=cfg, run_dir=tmp_path / "run") as mon:
        for step in range(3):
            x = torch.randn(4, 8)
            with mon.step(step, batch={"x": x}):
                loss = model(x * (float("nan") if step == 1 else 1.0)).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    root = next(a for a in mon.alerts if a.step == 1 and a.root)
    m = json.loads((tmp_path / "run" / root.capture / "manifest.json").read_text())
    assert m["lacks"] == ["model", "optimizer"] and "capture budget" in m["lacks_why"]
    assert "capture.max_bytes=524288" in root.message and mon.capture.copies == []


def test_the_latch_holds_skipped_steps_until_released():
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
    g = Guard(opt, hold=True)
    assert g.fused

    def skips(step, bad=0.0):
        g.before_step(torch.tensor(bad), step)
        out = float(opt.found_inf)
        g.after_step()
        return out > 0
    assert [skips(0), skips(1, 1.0), skips(2), skips(3)] == [False, True, True, True]
    g.release(0)                         # frames read through step 0 only: still held
    assert skips(4)
    g.release(1)                         # step 1's frame read (and copied): let go
    assert [skips(5), skips(6, 1.0)] == [False, True]
    # never released: the latch lets go by itself after HOLD_LIMIT steps
    held = [skips(s) for s in range(7, 7 + HOLD_LIMIT)]
    assert held == [True] * (HOLD_LIMIT - 1) + [False]


def test_capture_does_not_import_the_monitor():
    root = Path(sw.__file__).parent / "capture"
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                assert mod not in ("..monitor", "stabilitywatch.monitor"), path.name
                assert not (mod == ".." and any(a.name in ("monitor", "watch", "Monitor")
                                                for a in node.names)), path.name
            elif isinstance(node, ast.Import):
                assert all(a.name != "stabilitywatch.monitor" for a in node.names), path.name


def test_frames_handled_off_the_training_thread_copy_at_the_next_boundary(tmp_path,
                                                                          monkeypatch):
    """on_frame run from another thread only decides and queues: the copy of the state is taken
    on the training thread at the next step boundary, and the bundle still reproduces."""
    import threading

    from stabilitywatch.capture import manager

    where = []
    real_copy = manager.copy_state

    def spy(*a, **k):
        where.append(threading.get_ident())
        return real_copy(*a, **k)
    monkeypatch.setattr(manager, "copy_state", spy)

    def during(mon, step, model):
        if step == 0 and not hasattr(mon.capture, "_wrapped"):
            decide = mon.capture.on_frame
            mon.capture._wrapped = True

            def elsewhere(frame, alerts):
                out = []
                t = threading.Thread(target=lambda: out.append(decide(frame, alerts)))
                t.start()
                t.join(10)
                assert out, "on_frame did not return"
                return out[0]
            mon.capture.on_frame = elsewhere
    mon, _, _ = cm.train(tmp_path / "run", steps=6, config=unsampled(guard={"on_nonfinite": "skip"}),
                         during_step=during)
    # steps 3 and 4 (both skipped: fc2 stays scaled) each copied, on this (the training) thread
    assert where == [threading.get_ident()] * 2
    root = next(a for a in mon.alerts if a.step == 3 and a.root)
    bundle = tmp_path / "run" / root.capture
    assert json.loads((bundle / "manifest.json").read_text())["lacks"] == []
    assert sw.replay(bundle, **REPLAY)["reproduces"] is True
