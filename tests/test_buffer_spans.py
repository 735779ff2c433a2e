"""StatsBuffer resets and copies only the span of rows a step wrote (an unsampled step writes one
row of hundreds): a row written in one step never leaks into a later one, whatever the order of
steps, writes outside a step, or rows added mid-step."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rowcheck import assert_rows_match  # noqa: E402

from stabilitywatch.kernels.dispatch import accumulate  # noqa: E402
from stabilitywatch.kernels.backend import kernel_backend  # noqa: E402
from stabilitywatch.stats.buffer import StatsBuffer  # noqa: E402
from stabilitywatch.stats.reference import reference_row  # noqa: E402


def _t(seed, n=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * (seed + 1)


def _frame(buf):
    frames = buf.poll(block=True)
    assert len(frames) == 1
    f = frames[0]
    return {k: f.rows[i] for i, k in enumerate(f.keys)}


def _check(got, want):
    assert set(got) == set(want)
    for k, t in want.items():
        assert_rows_match(torch.from_numpy(got[k]), reference_row(t))


@pytest.mark.parametrize("capacity", [2, 64], ids=["grows", "fits"])
def test_rows_do_not_leak_between_steps(capacity):
    buf = StatsBuffer(capacity=capacity)
    a, b, c = ("a", "output"), ("b", "output"), ("c", "output")
    # step 0 writes three rows
    buf.begin_step(0)
    ts = {a: _t(0), b: _t(1), c: _t(2)}
    for (m, r), t in ts.items():
        buf.add(t, m, r, 0)
    buf.end_step()
    _check(_frame(buf), ts)
    # step 1 writes the middle row only: its span is one row
    buf.begin_step(1)
    t = _t(3)
    buf.add(t, *b, 0)
    buf.end_step()
    _check(_frame(buf), {b: t})
    # step 2 writes the first and last rows again: reset since step 0, nothing of it left
    buf.begin_step(2)
    ts = {a: _t(4), c: _t(5)}
    for (m, r), t in ts.items():
        buf.add(t, m, r, 0)
    buf.end_step()
    _check(_frame(buf), ts)
    # a write outside a step is reset by the next step's start
    buf.add(_t(6), *a, 0)
    buf.begin_step(3)
    t = _t(7)
    buf.add(t, *a, 0)
    d = ("d", "output")  # a new row mid-step (the rows grow when capacity is 2)
    td = _t(8)
    buf.add(td, *d, 0)
    buf.end_step()
    _check(_frame(buf), {a: t, d: td})
    # a step that writes nothing after one that wrote the new row
    buf.begin_step(4)
    buf.end_step()
    assert buf.poll(block=True) == []
    buf.begin_step(5)
    t = _t(9)
    buf.add(t, *d, 0)
    buf.end_step()
    _check(_frame(buf), {d: t})


def test_micro_batches_still_merge_within_a_step():
    buf = StatsBuffer()
    buf.begin_step(0)
    x, y = _t(0), _t(1)
    buf.add(x, "a", "output", 0)
    buf.add(y, "a", "output", 0)
    buf.end_step()
    _check(_frame(buf), {("a", "output"): torch.cat([x, y])})
    buf.begin_step(1)
    buf.add(y, "a", "output", 0)
    buf.end_step()
    _check(_frame(buf), {("a", "output"): y})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kept_launches_and_overwrites_across_steps(backend):
    # add_many's kept plan (the same tensors on the next call) writes rows without _prepare,
    # through its kept launches (triton: the interpreter here); overwrite writes twice in a
    # step; a step writing a subset follows one writing all
    buf = StatsBuffer(kernel_backend(backend), capacity=2)
    ts = [_t(k) for k in range(4)]
    items = [(t, f"m{k}", "grad", 1.0) for k, t in enumerate(ts)]
    keys = [(f"m{k}", "grad") for k in range(4)]
    for step in range(3):
        buf.begin_step(step)
        buf.add_many(items, 0, overwrite=True)
        buf.add(_t(9), "m0", "grad", 0, overwrite=True)  # the last write wins
        buf.end_step()
        want = dict(zip(keys, ts))
        want[keys[0]] = _t(9)
        _check(_frame(buf), want)
    buf.begin_step(3)
    buf.add(ts[2], "m2", "grad", 0)
    buf.add_many([], 1)  # an empty tap (the optimizer's state before its first step)
    buf.add_many([], 1)
    buf.end_step()
    _check(_frame(buf), {keys[2]: ts[2]})


def test_rows_written_unseen_by_compiled_code_are_reset():
    # compiled code writes rows through the custom op, without the host's bookkeeping: a step
    # in which it has (its graph marks the step) reads every row, and the next step resets them
    buf = StatsBuffer()
    buf.begin_step(0)
    x = _t(0)
    buf.add(x, "a", "output", 0)
    buf.add(_t(1), "b", "output", 0)
    buf.end_step()
    _check(_frame(buf), {("a", "output"): x, ("b", "output"): _t(1)})
    for step, seed in ((1, 2), (2, 3)):
        buf.begin_step(step)
        buf.mark_untracked()  # what the monitor does on a step its compiled graphs read
        slot, scale = buf.traced_slot("b", "output", torch.device("cpu"), 1.0, 0)
        y = _t(seed)
        accumulate(y, buf.rows_of(torch.device("cpu"))[slot], scale, "torch")
        buf.end_step()
        _check(_frame(buf), {("b", "output"): y})  # b alone, and no trace of the last step
    # a slot first seen by compiled code is made on the host while it traces
    slot, _ = buf.traced_slot("c", "grad_output", torch.device("cpu"), 1.0, 1)
    assert buf.keys[slot] == ("c", "grad_output") and buf.phase_of[slot] == 1
    # an unsampled step (its graph writes nothing, no mark): the rows the last compiled step
    # wrote are reset, and only what the host wrote is read
    buf.begin_step(3)
    z = _t(4)
    buf.add(z, "a", "output", 0)
    buf.end_step()
    _check(_frame(buf), {("a", "output"): z})


def test_the_buffer_takes_a_row_backend_not_a_name():
    # stats/ does not import kernels/: the kernels reach the buffer as a RowBackend
    with pytest.raises(TypeError, match="kernel_backend"):
        StatsBuffer("triton")
    assert StatsBuffer().backend == "torch"
    assert StatsBuffer(kernel_backend("auto")).backend == "auto"
    with pytest.raises(ValueError, match="backend must be"):
        kernel_backend("cuda")
