"""GPU-only: capture and replay of the demo's fault on CUDA (the snapshot's no-sync property is
covered by test_monitor_gpu.py::test_monitored_steps_do_not_sync, capture being on by default)."""
import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.demo import FAULT_MODULE, MODEL_FACTORY, STEP_FN, run_demo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_and_replay_on_cuda(tmp_path):
    r = run_demo(tmp_path / "run", device="cuda", steps=5, fault_step=1)
    caps = sorted({a.capture for a in r.alerts if a.capture})
    assert caps == ["captures/step00000001-rank0", "captures/step00000004-rank0"]
    for c in caps:
        rep = sw.replay(tmp_path / "run" / c, device="cuda", progress=False,
                        model_factory=MODEL_FACTORY, step_fn=STEP_FN)
        assert rep["first_divergent_module"] == FAULT_MODULE, c
        assert rep["reproduces"] is True, rep["reproduce"]["verdict"]


def test_host_ring_on_a_side_stream_captures_start_of_step_state(tmp_path):
    # capture.snapshot_to="host": the ring is pinned host memory filled on a side stream that
    # the optimizer step waits for; the bundle must still hold the weights the step began with,
    # and replay must reproduce the step bit for bit
    from dataclasses import replace

    from stabilitywatch.demo import demo_config
    cfg = demo_config().replace(capture={"snapshot_to": "host"})
    r = run_demo(tmp_path / "run", device="cuda", steps=5, fault_step=1, config=cfg)
    caps = sorted({a.capture for a in r.alerts if a.capture})
    assert caps == ["captures/step00000001-rank0", "captures/step00000004-rank0"]
    for c in caps:
        rep = sw.replay(tmp_path / "run" / c, device="cuda", progress=False,
                        model_factory=MODEL_FACTORY, step_fn=STEP_FN)
        assert rep["reproduces"] is True, rep["reproduce"]["verdict"]
        assert rep["first_divergent_module"] == FAULT_MODULE, c


def _host_ring_run(run_dir, **adamw):
    # four monitored steps of a small MLP, the snapshot ring in pinned host memory
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw)
    mon = sw.watch(model, opt, config=sw.Config(every=1, sinks=(), capture={"snapshot": "sampled",
                                                "snapshot_to": "host"}), run_dir=run_dir)
    for step in range(4):
        with mon.step(step, batch=torch.randn(16, 64, device="cuda")):
            loss = model(torch.randn(16, 64, device="cuda")).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    return mon


def test_host_ring_with_cpu_optimizer_state(tmp_path):
    # non-fused AdamW keeps `step` on the CPU: the device tensors still go through the flat
    # pinned buffer on the side stream (not back onto the current stream), the CPU ones apart
    mon = _host_ring_run(tmp_path, foreach=False)
    slot = max((s for s in mon.capture.snap.slots if s.step is not None), key=lambda s: s.step,
               default=None) or mon.capture.snap.slots[0]
    assert slot.host is not None and slot.ready is not None   # the side-stream path
    steps = {k: v for k, v in slot.optim.items() if k.endswith(".step")}
    assert steps and all(not v.is_cuda for v in steps.values())
    assert all(i not in slot.host.flat_index for i, (k, _) in
               enumerate(list(slot.model.items()) + list(slot.optim.items())) if k in steps)
    mon.close()


def test_auto_ring_counts_the_optimizer_state_to_come():
    # Before the first optimizer step Adam has no state: a ring sized on the weights alone would
    # fit the device's 1 % (2 x 0.4 % here) and go there, then move to the host once the state
    # exists (3 x that). The first snapshot must already go to the host.
    from stabilitywatch.capture.snapshot import Snapshotter
    total = torch.cuda.get_device_properties(0).total_memory
    n = int(total * 0.004) // 4  # float32 weights: 0.4 % of the device
    model = torch.nn.Linear(1, n, bias=False).cuda()
    opt = torch.optim.AdamW(model.parameters())
    snap = Snapshotter(model, opt, ring=2)
    before = torch.cuda.memory_allocated()
    slot = snap.take(0, None, 0)
    assert slot is not None and slot.host is not None  # pinned host ring, no device copy
    assert torch.cuda.memory_allocated() - before < 4 * n // 2
    snap.close()


def test_host_ring_copy_plans_are_kept(tmp_path, monkeypatch):
    # each slot of the ring builds its copy plan once while the tensors stay where they are
    # (the two slots used to throw each other's plan away when they took turns: one rebuild
    # per snapshot, ~4 ms of host time on GPT-2 small)
    from stabilitywatch.capture import snapshot
    built = []

    class Counted(snapshot.Gather):
        def __init__(self, *a, **k):
            built.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(snapshot, "Gather", Counted)
    mon = _host_ring_run(tmp_path, fused=True)  # the optimizer's state exists from here on
    ring = mon.capture.snap
    ring.release_through(10**9)
    before, slots = len(built), set()
    for k in range(6):  # the GPU a step behind: the last step's slot is held at each snapshot
        a = ring.take(100 + 2 * k, None, 100 + 2 * k)
        b = ring.take(101 + 2 * k, None, 101 + 2 * k)
        assert a is not None and b is not None and a is not b
        slots |= {id(a), id(b)}
        ring.release_through(101 + 2 * k)
    torch.cuda.synchronize()
    mon.close()
    assert len(slots) == 2
    assert len(built) - before <= 2, len(built) - before  # at most a first plan per slot
