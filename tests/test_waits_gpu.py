"""GPU-only: what would make a monitored step wait, counted after warm-up. Pinned host
allocations (cudaHostAlloc blocks the host for as long as the pages take to lock), event and
stream synchronisations from the monitor's own code on the training thread, and step starts
waiting for the frame processing thread. Run on a CUDA machine with STABILITYWATCH_REAL_TRITON=1:

    STABILITYWATCH_REAL_TRITON=1 python -m pytest -q tests/test_waits_gpu.py
"""
import os
import sys
import threading

import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.capture.rng import RngStates
from stabilitywatch.demo import build_model, make_batch, train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARM, STEPS = 12, 36   # the default config samples steps 0-9 (warmup), then 10, 20, 30


def _waits_from_the_monitor(calls: list):
    """Wrap Event.synchronize, Stream.synchronize and torch.cuda.synchronize: a call from a
    stabilitywatch frame on the training thread (not from close()) is recorded."""
    me = threading.get_ident()
    saved = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
             (torch.cuda, "synchronize")]
    originals = [getattr(o, n) for o, n in saved]

    def wrap(fn, what):
        def f(*a, **k):
            if threading.get_ident() == me:
                frame = sys._getframe(1)
                while frame is not None:
                    name = frame.f_code.co_filename
                    if frame.f_code.co_name == "close" and name.endswith("monitor.py"):
                        break
                    if f"{os.sep}stabilitywatch{os.sep}" in name:
                        calls.append(f"{what} from {name}:{frame.f_lineno}")
                        break
                    frame = frame.f_back
            return fn(*a, **k)
        return f
    for (o, n), fn in zip(saved, originals):
        setattr(o, n, wrap(fn, n))
    return lambda: [setattr(o, n, fn) for (o, n), fn in zip(saved, originals)]


@pytest.mark.parametrize("extra", [{}, {"guard": {"on_nonfinite": "skip"}}],
                         ids=["default", "guard"])
def test_no_pinned_allocation_and_no_wait_after_warmup(tmp_path, extra):
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    model = build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)
    data = [make_batch(gen, "cuda") for _ in range(4)]
    mon = sw.watch(model, opt, config=sw.Config(**extra), run_dir=tmp_path)
    calls: list = []
    allocs = {}
    restore = None
    try:
        for step in range(STEPS):
            if step == WARM:
                torch.cuda.synchronize()
                allocs["warm"] = torch.cuda.host_memory_stats().get("num_host_alloc")
                waited = mon.processor.waited
                restore = _waits_from_the_monitor(calls)
            batch = data[step % len(data)]
            with mon.step(step, batch=batch):
                loss = train_step(model, batch)
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
        allocs["end"] = torch.cuda.host_memory_stats().get("num_host_alloc")
        waited = mon.processor.waited - waited
    finally:
        if restore is not None:
            restore()
        mon.close()
    assert allocs["warm"] is not None, "torch.cuda.host_memory_stats() has no num_host_alloc"
    assert allocs["end"] == allocs["warm"], allocs
    assert not calls, calls
    # frames of this small model are processed long before the next step starts
    assert waited < 0.05 * (STEPS - WARM), waited


def test_cuda_rng_states_are_get_rng_state_all():
    torch.cuda.init()
    torch.cuda.manual_seed_all(7)
    torch.randn(3, device="cuda")   # moves the offset
    st = RngStates().read()
    want = torch.cuda.get_rng_state_all()
    assert len(st["cuda"]) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(st["cuda"], want))
