"""GPU-only: capture and replay of the demo's fault on CUDA (the snapshot's no-sync property is
covered by test_monitor_gpu.py::test_monitored_steps_do_not_sync, capture being on by default)."""
import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.demo import FAULT_MODULE, run_demo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_and_replay_on_cuda(tmp_path):
    r = run_demo(tmp_path / "run", device="cuda", steps=5, fault_step=1)
    caps = sorted({a.capture for a in r.alerts if a.capture})
    assert caps == ["captures/step00000001-rank0", "captures/step00000004-rank0"]
    for c in caps:
        rep = sw.replay(tmp_path / "run" / c, device="cuda", progress=False)
        assert rep["first_divergent_module"] == FAULT_MODULE, c
        assert rep["reproduces"] is True, rep["reproduce"]["verdict"]


def test_host_ring_on_a_side_stream_captures_start_of_step_state(tmp_path):
    # capture_snapshot_to="host": the ring is pinned host memory filled on a side stream that
    # the optimizer step waits for; the bundle must still hold the weights the step began with,
    # and replay must reproduce the step bit for bit
    from dataclasses import replace

    from stabilitywatch.demo import demo_config
    cfg = replace(demo_config(), capture_snapshot_to="host")
    r = run_demo(tmp_path / "run", device="cuda", steps=5, fault_step=1, config=cfg)
    caps = sorted({a.capture for a in r.alerts if a.capture})
    assert caps == ["captures/step00000001-rank0", "captures/step00000004-rank0"]
    for c in caps:
        rep = sw.replay(tmp_path / "run" / c, device="cuda", progress=False)
        assert rep["reproduces"] is True, rep["reproduce"]["verdict"]
        assert rep["first_divergent_module"] == FAULT_MODULE, c
