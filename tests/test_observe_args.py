"""Monitor.observe refuses bad arguments before anything reaches the buffer, and the buffer stays
consistent when a record fails for any other reason: one bad call never switches other taps off."""
import collections
import json
import logging
import os
import sys

import numpy as np
import pytest
import torch

import stabilitywatch as sw
from stabilitywatch.stats.buffer import Phase, StatsBuffer

sys.path.insert(0, os.path.dirname(__file__))
from test_monitor import batches, cfg, make  # noqa: E402

FLT_MAX = float(torch.finfo(torch.float32).max)
STEPS = 21


def _run(tmp_path, name, first_step=None):
    """The issue's sequence: `first_step(mon)` inside step 0, then 20 normal steps (every fifth
    sampled, whatever they cost: two runs compare step by step). Returns the (module, tensor)
    keys of stats.jsonl per step."""
    model, opt = make()
    with sw.watch(model, opt, config=cfg(every=5, warmup=1, cost_budget=0),
                  run_dir=tmp_path / name) as mon:
        for step, x in enumerate(batches(STEPS)):
            with mon.step(step, batch=x):
                if first_step is not None and step == 0:
                    first_step(mon)
                loss = model(x).square().mean()
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad()
    rows = collections.defaultdict(list)
    for line in open(tmp_path / name / "stats.jsonl"):
        r = json.loads(line)
        rows[r["step"]].append((r["module"], r["tensor"]))
    return mon, [sorted(rows[s]) for s in range(STEPS)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("clean"), "run")[1]


def test_bad_scale_in_the_first_step_is_refused_and_the_run_is_unchanged(tmp_path, clean):

    def bad(mon):
        with pytest.raises(TypeError, match="scale must be a positive number.*'abc'"):
            mon.observe(torch.ones(3), "r", scale="abc")
    mon, got = _run(tmp_path, "bad", bad)
    assert got == clean
    assert len(clean[5]) > 20          # forward, backward, gradient and optimizer rows, the loss
    # an unsampled step: the loss, and the sentinel's global gradient norm
    assert sorted(clean[6]) == [("", "grad_norm"), ("", "loss")]
    assert not mon.taps._failed
    assert ("", "r") not in mon.buffer.slot_of


def test_record_failing_inside_the_buffer_leaves_other_rows_alone(tmp_path, caplog, clean):
    # a scale tensor on the meta device passes the argument checks (a device value is never
    # read) and fails inside the buffer, where the row is being prepared
    meta = torch.tensor(2.0, device="meta")
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        mon, got = _run(tmp_path, "bad", lambda mon: mon.observe(torch.ones(3), "r", scale=meta))
    assert got == clean                # no half-made ("", "r") row in step 0
    assert not mon.taps._failed
    assert [r.getMessage() for r in caplog.records if "observing" in r.getMessage()] != []


GOOD = torch.ones(4)


@pytest.mark.parametrize("args, kw, exc, needle", [
    (([1.0, 2.0], "r"), {}, TypeError, "tensor must be a torch.Tensor, got list"),
    ((np.ones(3), "r"), {}, TypeError, "tensor must be a torch.Tensor, got ndarray"),
    ((GOOD, 3), {}, TypeError, "role must be a str, got int"),
    ((GOOD, None), {}, TypeError, "role must be a str"),
    ((GOOD, ""), {}, ValueError, "role must be a non-empty name"),
    ((GOOD, "fp8 input"), {}, ValueError, "role 'fp8 input' holds ' '"),
    ((GOOD, "r\n"), {}, ValueError, "role 'r\\\\n' holds"),
    ((GOOD, "r\x00"), {}, ValueError, "role 'r\\\\x00' holds"),
    ((GOOD, "r\u200b"), {}, ValueError, "role"),                 # zero-width space (format char)
    ((GOOD, "r"), {"module": 3}, TypeError, "module must be a str, got int"),
    ((GOOD, "r"), {"module": "blocks 0"}, ValueError, "module 'blocks 0' holds"),
    ((GOOD, "r"), {"scale": "abc"}, TypeError, "scale must be a positive number.*'abc'"),
    ((GOOD, "r"), {"scale": True}, TypeError, "scale must be a positive number.*True"),
    ((GOOD, "r"), {"scale": [2.0]}, TypeError, "scale must be a positive number"),
    ((GOOD, "r"), {"scale": 1 + 2j}, TypeError, "scale must be a positive number"),
    ((GOOD, "r"), {"scale": float("nan")}, ValueError, "finite positive.*nan"),
    ((GOOD, "r"), {"scale": float("inf")}, ValueError, "finite positive.*inf"),
    ((GOOD, "r"), {"scale": 0.0}, ValueError, "finite positive.*0.0"),
    ((GOOD, "r"), {"scale": -2.0}, ValueError, "finite positive.*-2.0"),
    ((GOOD, "r"), {"scale": 1e-50}, ValueError, "normal range.*1e-50"),
    ((GOOD, "r"), {"scale": 1e39}, ValueError, "normal range.*1e\\+39"),
    ((GOOD, "r"), {"scale": 10 ** 400}, ValueError, "normal range"),
    ((GOOD, "r"), {"scale": torch.tensor([1.0, 2.0])}, ValueError, "0-dim.*shape \\(2,\\)"),
    ((GOOD, "r"), {"scale": torch.tensor(2)}, ValueError, "floating tensor.*torch.int64"),
    ((GOOD, "r"), {"scale": torch.tensor(2 + 0j)}, ValueError, "floating tensor.*complex"),
], ids=["tensor-list", "tensor-ndarray", "role-int", "role-none", "role-empty", "role-space",
        "role-newline", "role-nul", "role-zero-width", "module-int", "module-space",
        "scale-str", "scale-bool", "scale-list", "scale-complex", "scale-nan", "scale-inf",
        "scale-zero", "scale-negative", "scale-tiny", "scale-huge", "scale-huge-int",
        "scale-tensor-2", "scale-tensor-int", "scale-tensor-complex"])
@pytest.mark.parametrize("inside", [True, False], ids=["in-step", "outside-step"])
def test_bad_observe_arguments_raise_naming_the_argument(tmp_path, args, kw, exc, needle, inside):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        slots = dict(mon.buffer.slot_of)
        if inside:
            with mon.step(0):
                slots, touched = dict(mon.buffer.slot_of), dict(mon.buffer._touched)
                with pytest.raises(exc, match=needle):
                    mon.observe(*args, **kw)
                assert mon.buffer._touched == touched
        else:
            with pytest.raises(exc, match=needle):
                mon.observe(*args, **kw)
        assert mon.buffer.slot_of == slots                 # nothing reached the buffer


@pytest.mark.parametrize("scale", [None, 1, 2.5, np.float32(4.0), 2.0 ** -126, FLT_MAX,
                                   torch.tensor(8.0), torch.tensor([8.0]),
                                   torch.tensor(8.0, dtype=torch.float64)],
                         ids=["none", "int", "float", "numpy", "min-normal", "max", "tensor-0d",
                              "tensor-1", "tensor-f64"])
def test_good_observe_arguments_are_recorded(tmp_path, scale):
    model, opt = make()
    t = torch.linspace(-3, 3, 64)
    with sw.watch(model, opt, config=cfg(formats={"fp8.x": "e4m3"}), run_dir=tmp_path) as mon:
        with mon.step(0):
            mon.observe(t, "fp8.x", module="fc1", scale=scale)
            mon.observe(t, "amax_history-2:w", module="")     # punctuation is fine
            with pytest.raises(ValueError, match="whitespace"):
                mon.observe(t, "amax history", module="")     # whitespace is not
    recs = map(json.loads, open(tmp_path / "stats.jsonl"))
    frame_keys = {(r["module"], r["tensor"]): r for r in recs}
    rec = frame_keys[("fc1", "fp8.x")]
    want = sw.tensor_stats(t, scale=1.0 if scale is None else float(scale))
    assert rec["stats"]["numel"] == 64
    assert rec["stats"]["e4m3_overflow"] == want["e4m3_overflow"]
    assert ("", "amax_history-2:w") in frame_keys


@pytest.mark.parametrize("good, bad", [(2.0 ** -126, 2.0 ** -127), (FLT_MAX, FLT_MAX * 1.0000001)],
                         ids=["low", "high"])
def test_scale_range_ends_at_float32_normal_range(tmp_path, good, bad):
    model, opt = make()
    with sw.watch(model, opt, config=cfg(), run_dir=tmp_path) as mon:
        with mon.step(0):
            mon.observe(torch.ones(4), "x", scale=good)
            with pytest.raises(ValueError, match="normal range"):
                mon.observe(torch.ones(4), "x", scale=bad)


# -- the buffer on its own: a failed write leaves it whole ---------------------------------------

def _same_lengths(buf):
    n = len(buf.keys)
    assert len(buf.scales) == len(buf.device_of) == len(buf.phase_of) == len(buf.slot_of) == n
    assert sorted(buf.slot_of.values()) == list(range(n))


@pytest.mark.parametrize("capacity", [1, 64], ids=["grows", "fits"])
def test_buffer_bad_scale_makes_no_slot(capacity):
    buf = StatsBuffer(capacity=capacity)
    buf.begin_step(0)
    buf.add(torch.ones(3), "a", "output", Phase.FORWARD)
    with pytest.raises(ValueError):
        buf.add(torch.ones(3), "b", "output", Phase.FORWARD, scale="abc")
    _same_lengths(buf)
    buf.add(torch.full((5,), 2.0), "c", "output", Phase.FORWARD)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    assert frame.keys == [("a", "output"), ("c", "output")]
    assert [r[0] for r in frame.rows] == [3, 5]        # numel of each row


@pytest.mark.parametrize("bad", [torch.ones(3, dtype=torch.complex64),
                                 torch.ones(3, dtype=torch.int64)], ids=["complex", "int"])
def test_buffer_failed_write_is_not_read(bad):
    buf = StatsBuffer(capacity=4)
    for step in range(2):
        buf.begin_step(step)
        buf.add(torch.ones(3), "a", "output", Phase.FORWARD)
        with pytest.raises(TypeError):
            buf.add(bad, "b", "output", Phase.FORWARD)
        buf.end_step()
        (frame,) = buf.poll(block=True)
        assert frame.keys == [("a", "output")]          # no row for b: it was never written
        _same_lengths(buf)


def test_buffer_failed_write_of_a_row_written_before_drops_it():
    # a second micro-batch that fails: what the row holds is not the step's statistics
    buf = StatsBuffer(capacity=4)
    buf.begin_step(0)
    buf.add(torch.ones(3), "a", "output", Phase.FORWARD)
    buf.add(torch.ones(3), "b", "output", Phase.FORWARD)
    with pytest.raises(TypeError):
        buf.add(torch.ones(3, dtype=torch.int64), "b", "output", Phase.FORWARD)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    assert frame.keys == [("a", "output")]
    buf.begin_step(1)                                   # the next step reads b again, from zero
    buf.add(torch.ones(7), "b", "output", Phase.FORWARD)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    assert frame.keys == [("b", "output")] and frame.rows[0][0] == 7


@pytest.mark.parametrize("overwrite", [False, True], ids=["merge", "overwrite"])
def test_buffer_failed_add_many_reads_none_of_its_rows(overwrite):
    buf = StatsBuffer(capacity=2)
    good = [(torch.ones(3), "a", "grad", 1.0), (torch.ones(4), "b", "grad", 1.0)]
    buf.begin_step(0)
    buf.add(torch.ones(2), "x", "output", Phase.FORWARD)
    with pytest.raises(TypeError):
        buf.add_many(good + [(torch.ones(3, dtype=torch.int64), "c", "grad", 1.0)], Phase.GRAD,
                     overwrite)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    assert frame.keys == [("x", "output")]
    _same_lengths(buf)
    buf.begin_step(1)                                   # the same taps work on the next step
    buf.add_many(good, Phase.GRAD, overwrite)
    buf.end_step()
    (frame,) = buf.poll(block=True)
    assert frame.keys == [("a", "grad"), ("b", "grad")]
    assert [r[0] for r in frame.rows] == [3, 4]
