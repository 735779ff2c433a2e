"""The snapshot ring's gathered device-to-host copy (capture/staging.py), on CPU tensors: the
chunking and the views are device-independent (the GPU run is in test_capture_gpu.py)."""
import pytest
import torch

from stabilitywatch.capture.staging import Gather, HostBuffers, _words


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(37, 5, generator=g),                       # 185 words
        torch.randn(3, generator=g).to(torch.bfloat16),        # 6 bytes: not 32-bit words
        torch.randn(64, generator=g).to(torch.bfloat16),       # 32 words
        torch.tensor(7.0),                                     # 0-dim
        torch.randn(8, 6, generator=g).t(),                    # not contiguous
        torch.arange(10, dtype=torch.int64),                   # 20 words
        torch.randn(0, 4, generator=g),                        # empty
        torch.randn(1000, generator=g).to(torch.float16),      # 500 words
        torch.randn(128, generator=g)[1:],                     # contiguous, offset 4 bytes
    ]


@pytest.mark.parametrize("chunk_words", [1, 7, 64, 1 << 20], ids=lambda c: f"chunk{c}")
def test_gather_copies_every_flat_tensor(chunk_words):
    src = _tensors()
    host = HostBuffers(src, pin=False)
    assert set(host.flat_index) == {0, 2, 3, 5, 7, 8}   # word views exist for these
    for i, t in enumerate(src):
        assert host.views[i].shape == t.shape and host.views[i].dtype == t.dtype
    plan = Gather(src, host, chunk_words)
    assert all(hi - lo <= chunk_words for lo, hi, _, _ in plan.chunks)
    staging = torch.full((chunk_words,), -1, dtype=torch.int32)
    plan.run(host, staging)
    for i in host.flat_index:
        assert torch.equal(host.views[i], src[i]), i
    # the host views are slices of the flat buffer, 16-byte aligned
    for i, (off, n) in host.flat_index.items():
        assert off % 4 == 0 and host.views[i].data_ptr() == host.flat.data_ptr() + 4 * off


def test_apart_tensors_stay_out_of_the_flat_buffer():
    src = _tensors()
    host = HostBuffers(src, apart=frozenset({0, 5}), pin=False)
    assert 0 not in host.flat_index and 5 not in host.flat_index
    plan = Gather(src, host, 16)
    plan.run(host, torch.empty(16, dtype=torch.int32))
    host.views[0].copy_(src[0])   # the caller's own copy
    before = host.views[0].clone()
    plan.run(host, torch.empty(16, dtype=torch.int32))  # a second run must not touch it
    assert torch.equal(host.views[0], before)
    assert torch.equal(host.views[7], src[7])


def test_plan_key_follows_the_storage():
    src = _tensors()
    host = HostBuffers(src, pin=False)
    plan = Gather(src, host, 64)
    again = [t for t in src]
    assert Gather(again, host, 64).key == plan.key
    again[0] = src[0].clone()
    assert Gather(again, host, 64).key != plan.key


def test_words_view_rules():
    assert _words(torch.zeros(3, dtype=torch.bfloat16)) is None
    assert _words(torch.zeros(4, 4).t()) is None
    assert _words(torch.zeros(0)) is None
    assert _words(torch.zeros(2, dtype=torch.float64)).numel() == 4


def test_bundle_writes_views_of_one_buffer(tmp_path):
    # safetensors refuses tensors that share storage: the writer gives it copies
    from safetensors.torch import load_file

    from stabilitywatch.capture.writer import write_bundle
    src = _tensors()
    host = HostBuffers(src, pin=False)
    Gather(src, host, 64).run(host, torch.empty(64, dtype=torch.int32))
    group = {f"t{i}": host.views[i] for i in host.flat_index}
    out = write_bundle(tmp_path, "b", {"schema": 1}, {"model": group})
    back = load_file(str(out / "model.safetensors"))
    for k, v in group.items():
        assert torch.equal(back[k], v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory)")
def test_gather_on_cuda_through_a_side_stream():
    src = [t.cuda() for t in _tensors()] + [torch.randn(3_000_001, device="cuda")]
    host = HostBuffers(src)
    assert host.flat.is_pinned()
    plan = Gather(src, host, 100_000)
    staging = torch.empty(100_000, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(host, staging)
    side.synchronize()
    for i in host.flat_index:
        assert torch.equal(host.views[i], src[i].cpu()), i


def test_close_frees_the_snapshot_ring(tmp_path):
    # a closed monitor kept to read its alerts must not hold copies of the model
    import stabilitywatch as sw
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters())
    mon = sw.watch(model, opt, config=sw.Config(sinks=(), every=1, capture={"snapshot": "sampled"}),
                   run_dir=tmp_path)
    for step in range(3):
        with mon.step(step, batch=torch.randn(4, 8)):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        if step == 1:
            assert mon.capture.snap.nbytes > 0
    mon.close()
    assert mon.capture.snap.nbytes == 0
