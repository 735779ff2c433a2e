"""The hooks' records held back to share launches (stats/held.py): a step's rows are the rows of
the tensors as their hooks saw them, in the order the hooks ran, whether held or read at once;
a tensor written in place after its hook is never read with the new values; a failing launch
costs those rows and nothing else. Held records take the buffer's CPU path here (`hold_on`
names the CPU), and the multi-tensor kernels under the Triton interpreter."""
import dataclasses
import logging
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.kernels.backend import kernel_backend  # noqa: E402
from stabilitywatch.stats import held as held_mod  # noqa: E402
from stabilitywatch.stats.buffer import Phase, StatsBuffer  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402

F, B, L = Phase.FORWARD, Phase.BACKWARD, Phase.LOSS


def _t(seed, n=3000, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * (seed + 1)
    t[::101] = 0.0
    return t.to(dtype)


def _step(buf, step, writes, edit=None):
    """writes: (tensor, module, role, phase); edit(k) runs after the k-th write. The frame as
    {key: row} and its key order."""
    buf.begin_step(step)
    for k, (t, m, r, ph) in enumerate(writes):
        buf.add(t, m, r, ph)
        if edit is not None:
            edit(k)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    return {key: frame.rows[i] for i, key in enumerate(frame.keys)}, list(frame.keys)


def _writes(seed=0, dtype=torch.float32):
    w = [(_t(seed + i, dtype=dtype), f"m{i}", "output", F) for i in range(5)]
    w.append((_t(seed + 9).sum(), "", "loss", L))
    w += [(_t(seed + 20 + i, dtype=dtype), f"m{4 - i}", "grad_output", B) for i in range(3)]
    return w


def _buffers(backend="auto"):
    held, plain = StatsBuffer(kernel_backend(backend)), StatsBuffer(kernel_backend(backend))
    held.hold_on, plain.hold_on = ("cpu",), ()
    return held, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_held_rows_are_the_rows_read_at_once_in_the_same_order(dtype):
    held, plain = _buffers()
    for step in range(3):   # the second and third steps repeat the first one's launch plans
        writes = _writes(step * 50, dtype)
        got, got_keys = _step(held, step, writes)
        want, want_keys = _step(plain, step, writes)
        assert got_keys == want_keys == [(m, r) for _, m, r, _ in writes]
        for key, t in zip(want_keys, [w[0] for w in writes]):
            assert_rows_match(torch.from_numpy(got[key]), torch.from_numpy(want[key]))
            assert_rows_match(torch.from_numpy(got[key]), reference_row(t))
    assert ("held", F, 0) in held._plans and ("held", B, 0) in held._plans


def test_a_tensor_written_in_place_after_its_hook_is_left_out_then_read_at_its_hook(caplog):
    held, _ = _buffers()
    caplog.set_level(logging.WARNING, "stabilitywatch")
    for step in range(3):
        writes = _writes(step * 50)
        before = writes[1][0].clone()

        def relu_inplace(k):   # the next module writes m1's output in place
            if k == 1:
                writes[1][0].relu_()
        got, keys = _step(held, step, writes, relu_inplace)
        if step == 0:
            assert ("m1", "output") not in got
        else:   # read at its hook: its values before the ReLU
            assert_rows_match(torch.from_numpy(got[("m1", "output")]), reference_row(before))
        for key in [("m0", "output"), ("m2", "output"), ("", "loss")]:
            assert key in got
    msgs = [r.getMessage() for r in caplog.records if "in place" in r.getMessage()]
    assert len(msgs) == 1 and "m1 output" in msgs[0]


def test_held_tensors_launch_in_chunks_within_the_limits(monkeypatch):
    monkeypatch.setattr(held_mod, "FLUSH_COUNT", 2)
    held, plain = _buffers()
    seen = []
    put = held._held.put

    def watch_put(*a):
        flush = put(*a)
        seen.append(len(held._held.items))
        return flush
    monkeypatch.setattr(held._held, "put", watch_put)
    for step in range(2):
        writes = _writes(step)
        got, _ = _step(held, step, writes)
        want, _ = _step(plain, step, writes)
        for key in want:
            assert_rows_match(torch.from_numpy(got[key]), torch.from_numpy(want[key]))
    assert max(seen) == 2
    assert {("held", F, k) for k in range(3)} <= set(held._plans)


def test_large_tensors_are_read_at_their_hook(monkeypatch):
    monkeypatch.setattr("stabilitywatch.stats.buffer.HOLD_MAX_BYTES", 1000)
    held, _ = _buffers()
    held.begin_step(0)
    held.add(_t(1, n=200), "small", "output", F)
    assert len(held._held.items) == 1
    held.add(_t(2, n=3000), "large", "output", F)   # 12 KB: read now, after what was held
    assert not held._held.items
    held.end_step()
    (frame,) = held.poll(block=True)
    assert frame.keys == [("small", "output"), ("large", "output")]


def test_a_failing_launch_leaves_its_rows_out_and_turns_holding_off(caplog):
    def boom(items, name):
        raise RuntimeError("no launch")
    backend = kernel_backend("auto")
    buf = StatsBuffer(dataclasses.replace(backend, accumulate_each=boom))
    buf.hold_on = ("cpu",)
    caplog.set_level(logging.WARNING, "stabilitywatch")
    writes = _writes()
    got, keys = _step(buf, 0, writes)
    assert ("", "loss") in got and ("m0", "output") not in got
    assert buf.hold_on == ()
    assert any("tensors read together failed" in r.getMessage() for r in caplog.records)
    buf.ops = backend   # read at once from now on: every row comes back
    buf._accumulate = backend.accumulate
    got, keys = _step(buf, 1, writes)
    assert keys == [(m, r) for _, m, r, _ in writes]


@pytest.mark.interpreter
def test_held_rows_share_the_multi_tensor_kernels(monkeypatch):
    held, plain = _buffers("triton")
    launches = []
    many = held.ops.accumulate_many
    monkeypatch.setattr(held, "ops", dataclasses.replace(
        held.ops, accumulate_many=lambda *a: launches.append(1) or many(*a)))
    writes = [(_t(i, n=70000 + 7 * i, dtype=dt), f"m{i}", "output", F)
              for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float32])]
    writes.append((_t(9, n=77), "m9", "output", F))
    got, _ = _step(held, 0, writes)
    want, _ = _step(plain, 0, writes)
    assert launches == [1]   # one call for the four: a tile launch per dtype, the rest together
    for t, m, r, _ in writes:
        assert_rows_match(torch.from_numpy(got[(m, r)]), torch.from_numpy(want[(m, r)]),
                          sum_rtol=1e-9)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU(inplace=True)   # writes fc1's output after fc1's hook
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _run(hold: bool, tmp_path, steps=3, device="cpu", model=_Net):
    torch.manual_seed(0)
    net = model().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    mon = sw.watch(net, opt, config=sw.Config(every=1, sinks=(), capture=()),
                   run_dir=str(tmp_path / f"hold{hold}"))
    mon.buffer.hold_on = (device,) if hold else ()
    frames = []
    poll = mon.buffer.poll

    def keep(*a, **k):
        got = poll(*a, **k)
        frames.extend(got)
        return got
    mon.buffer.poll = keep
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 16, generator=g) if model is _Net
         else torch.randint(0, 512, (4, 64), generator=g)).to(device)
    for i in range(steps):
        with mon.step(i):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=model is not _Net):
                out = net(x) if model is _Net else net(input_ids=x).logits
            loss = out.float().square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    mon.close()
    return {f.step: {k: f.rows[j] for j, k in enumerate(f.keys)} for f in frames}


@pytest.mark.parametrize("model", [_Net, _llama], ids=["relu-inplace", "hf-llama-bf16"])
def test_a_watched_model_gives_the_same_rows_held_or_not(tmp_path, caplog, model):
    caplog.set_level(logging.WARNING, "stabilitywatch")
    got, want = _run(True, tmp_path, model=model), _run(False, tmp_path, model=model)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    # fc1's output is written by the in-place ReLU: left out of the first step only
    inplace = {("fc1", "output")} if model is _Net else set()
    assert set(want[0]) - set(got[0]) == inplace
    assert len(want[2]) > (10 if model is _Net else 80)
    for step in (0, 1, 2):
        assert set(got[step]) == set(want[step]) - (inplace if step == 0 else set())
        for key, row in got[step].items():
            assert_rows_match(torch.from_numpy(row), torch.from_numpy(want[step][key]))
    warned = sum("fc1 output was written in place" in r.getMessage() for r in caplog.records)
    assert warned == (model is _Net)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", [_Net, _llama], ids=["relu-inplace", "hf-llama-bf16"])
def test_on_the_gpu_held_rows_match_the_rows_read_at_once(tmp_path, model):
    got = _run(True, tmp_path, device="cuda", model=model)
    want = _run(False, tmp_path, device="cuda", model=model)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    inplace = {("fc1", "output")} if model is _Net else set()
    assert set(want[0]) - set(got[0]) == inplace
    assert len(want[2]) > (10 if model is _Net else 80)
    # the Llama's later steps start from weights updated by kernels that may round differently
    # run to run (atomics): its first step is compared
    for step in (0, 1, 2) if model is _Net else (0,):
        assert set(got[step]) == set(want[step]) - (inplace if step == 0 else set())
        for key, row in got[step].items():
            # other kernels (the multi-tensor launches): sums may round differently
            assert_rows_match(torch.from_numpy(row), torch.from_numpy(want[step][key]),
                              sum_rtol=1e-9)
