"""GPU-only: monitored training steps never synchronise with the host, and the kernel path
gives the rows the reference gives. Run on a CUDA machine with STABILITYWATCH_REAL_TRITON=1."""
import json

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.demo import build_model, make_batch, train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def train_without_syncs(tmp_path, config: sw.Config, before_close=None,
                        steps: int = 6) -> sw.Monitor:
    """`steps` monitored steps of the demo model; from step 2 on (after allocations and kernel
    compilation) under set_sync_debug_mode("error"). Returns the closed monitor
    (before_close(mon) runs before it closes)."""
    model = build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)
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
    if before_close is not None:
        before_close(mon)
    mon.close()
    return mon


def test_monitored_steps_do_not_sync(tmp_path):
    config = sw.Config(every=1, roles=tuple(sw.Role), formats={"output": "e4m3"},
                       sinks=("jsonl",))
    mon = train_without_syncs(tmp_path, config)
    assert not mon.taps._failed
    steps = {json.loads(line)["step"] for line in open(tmp_path / "stats.jsonl")}
    assert steps == set(range(6))


def test_sentinel_and_guard_do_not_sync(tmp_path):
    """Unsampled steps (every=10, warmup=0): the every-step sentinel kernel, its copy to pinned
    memory and the guard's found_inf for the fused AdamW, under sync-debug "error"; a NaN put
    into one gradient on the device at step 4 is named at that step and the step is skipped."""
    holder = {}

    def before_close(mon):
        holder["launches"] = mon.buffer.sentinel.launches
        holder["kernel"] = bool(mon.buffer.sentinel._plan and mon.buffer.sentinel._plan.launches)
    config = sw.Config(every=10, warmup=0, guard={"on_nonfinite": "skip"}, sinks=("jsonl",))
    model = build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)
    data = [make_batch(gen, "cuda") for _ in range(8)]
    target = next(p for p in model.parameters() if p.dim() == 2)
    mon = sw.watch(model, opt, config=config, run_dir=tmp_path)
    try:
        for step in range(8):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            with mon.step(step, batch=data[step]):
                loss = train_step(model, data[step])
                loss.backward()
                mon.observe_loss(loss)
                if step == 4:
                    target.grad.view(-1)[7:8].fill_(float("nan"))   # on the device, no sync
                    w = target.detach().clone()
                opt.step()
                if step == 4:   # read after the loop: a comparison here would sync
                    holder["moved"] = (target.detach() - w).abs().max()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    before_close(mon)
    mon.close()
    assert holder["launches"] == 8 and holder["kernel"] and not mon.sentinel.failed
    assert holder["moved"].item() == 0.0
    crit = [a for a in mon.alerts if a.severity.value == "critical"]
    assert crit and crit[0].step == 4 and crit[0].tensor.startswith("grad")
    assert crit[0].extra.get("skipped") is True
    # its bundle: the guard held step 4's state (step 5 skipped too when the GPU runs a step
    # behind and the frame is read at step 5's end) and the capture copied it at a step
    # boundary, without a sync the debug mode flags
    from stabilitywatch.capture.reader import open_capture
    cap = open_capture(tmp_path / crit[0].capture)
    held = cap.manifest["held"]
    assert cap.manifest["lacks"] == [] and held["first"] == 4 and held["skipped_steps"] >= 1
    assert crit[0].extra["held_steps"] == held["skipped_steps"]
    name = next(n for n, p in model.named_parameters() if p is target)
    assert torch.equal(cap.tensors("model")[name], w.cpu())


def test_sentinel_kernel_equals_twin_on_gpu():
    from stabilitywatch.kernels.sentinel import SentinelLaunch
    from stabilitywatch.stats.sentinel import sentinel_reference
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ts = [torch.randn(n, device="cuda", generator=g).to(dtype)
              for n in (1, 127, 4097, 65536 * 3 + 5, 1 << 20)]
        ts[2][5] = float("nan")
        ts[3][-1] = float("inf")
        ref = torch.zeros(len(ts), 4, dtype=torch.float64, device="cuda")
        sentinel_reference(ts, ref, list(range(len(ts))))
        out = torch.zeros_like(ref)
        SentinelLaunch(ts, list(range(len(ts))), out.device).run(out)
        assert torch.equal(out[:, [0, 1, 3]], ref[:, [0, 1, 3]]), dtype
        assert torch.allclose(out[:, 2], ref[:, 2], rtol=1e-5), dtype


def test_kernel_rows_equal_reference_rows_in_a_run(tmp_path):
    model = build_model().cuda()
    batch = make_batch(torch.Generator().manual_seed(0), "cuda")
    recs = {}
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        m = build_model().cuda()
        d = tmp_path / backend
        with sw.watch(m, config=sw.Config(every=1, backend=backend, sinks=("jsonl",)),
                      run_dir=d) as mon:
            with mon.step(0, batch=batch):
                train_step(m, batch).backward()
        recs[backend] = {(r["module"], r["tensor"]): r["stats"]
                         for r in map(json.loads, open(d / "stats.jsonl"))}
    assert recs["triton"].keys() == recs["torch"].keys()
    for key, a in recs["triton"].items():
        b = recs["torch"][key]
        if key == ("", "grad_norm"):
            assert a["l2norm"] == pytest.approx(b["l2norm"], rel=1e-9)
            continue
        for k in ("numel", "nan", "zeros", "min", "max", "absmax", "absmin_nonzero",
                  "e4m3_overflow", "e4m3_underflow", "fp16_underflow"):
            assert a[k] == b[k], (key, k, a[k], b[k])
        assert a["mean"] == pytest.approx(b["mean"], rel=1e-9, abs=1e-12), key
    del model


def test_host_snapshot_ring_does_not_sync(tmp_path):
    # the side-stream copy into pinned memory and the optimizer's wait on it are sync-free
    seen = {}

    def ring(mon):  # the pinned flat buffer and its views, while the monitor is open
        slot = mon.capture.snap.slots[0]
        seen.update(model=bool(slot.model), pinned=slot.host is not None and
                    slot.host.flat.is_pinned())

    mon = train_without_syncs(tmp_path, sw.Config(every=1, sinks=("jsonl",),
                                                  capture={"snapshot": "sampled",
                                                           "snapshot_to": "host"}), ring)
    assert not mon.capture.snap.disabled and seen == {"model": True, "pinned": True}
    assert mon.capture.snap.nbytes == 0   # close() freed the ring
    assert not mon.taps._failed
