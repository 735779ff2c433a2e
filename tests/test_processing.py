"""Frame processing off the training thread (stabilitywatch/processing.py): detectors run on the
processing thread in step order, a stuck or failing stage never stalls or breaks the step,
close() drains every frame, and Config(processing="inline") keeps it on the training thread."""
import json
import logging
import threading
import time

import pytest
import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.alert import Alert, Severity
from stabilitywatch.detectors.base import Detector
from stabilitywatch.processing import THREAD_NAME


class Probe(Detector):
    """Notes the thread and step of every frame it sees; one info alert per step."""
    name = "spike"

    def __init__(self, delay: float = 0.0):
        self.seen: list[tuple[int, int, str]] = []
        self.delay = delay

    def check(self, frame):
        t = threading.current_thread()
        if self.delay:
            time.sleep(self.delay)
        self.seen.append((frame.step, t.ident, t.name))
        return [Alert(step=frame.step, detector=self.name, severity=Severity.INFO, module="",
                      tensor="loss", stat="probe", value=float(frame.step), threshold=0.0,
                      message="probe")]


class Stuck(Detector):
    """Blocks on `release` at step `at` (at most `limit` s: the test's own bound), then returns
    an alert that must never be recorded; raises at step `fail_at`."""
    name = "drift"

    def __init__(self, at: int, limit: float = 20.0, fail_at: int = -1):
        self.at, self.limit, self.fail_at = at, limit, fail_at
        self.release = threading.Event()
        self.returned = threading.Event()

    def check(self, frame):
        if frame.step == self.fail_at:
            raise RuntimeError("a bad detector")
        if frame.step != self.at:
            return []
        self.release.wait(self.limit)
        self.returned.set()
        return [Alert(step=frame.step, detector=self.name, severity=Severity.CRITICAL,
                      module="", tensor="loss", stat="late", value=1.0, threshold=0.0,
                      message="late")]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(mon, model, opt, steps, durations=None):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 8, generator=g)
        t0 = time.monotonic()
        with mon.step(step, batch=x):
            loss = model(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        if durations is not None:
            durations.append(time.monotonic() - t0)


def _cfg(**kw):
    return sw.Config(**{"every": 1, "warmup": 0, "sinks": ("jsonl",), "detectors": (),
                        "capture": (), "escalate_steps": 0, "incidents": {"cooldown": 0}, **kw})


def _stat_steps(run_dir):
    return [json.loads(line)["step"] for line in open(run_dir / "stats.jsonl")]


def test_frames_are_processed_on_the_processing_thread_in_step_order(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe()
    mon = sw.watch(model, opt, config=_cfg(), run_dir=tmp_path)
    mon.detectors.append(probe)
    _train(mon, model, opt, 8)
    mon.close()
    main = threading.get_ident()
    assert [s for s, _, _ in probe.seen] == list(range(8))
    assert all(ident != main and name == THREAD_NAME for _, ident, name in probe.seen)
    steps = _stat_steps(tmp_path)
    assert sorted(set(steps)) == list(range(8)) and steps == sorted(steps)
    assert [a.step for a in mon.alerts if a.stat == "probe"] == list(range(8))
    assert not any(t.name == THREAD_NAME for t in threading.enumerate()
                   if t.is_alive() and t is not threading.current_thread())


def test_inline_processing_stays_on_the_training_thread(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe()
    mon = sw.watch(model, opt, config=_cfg(processing="inline"), run_dir=tmp_path)
    mon.detectors.append(probe)
    _train(mon, model, opt, 3)
    # inline, a step's alerts are in mon.alerts right after the step (CPU: read at its end)
    assert [a.step for a in mon.alerts if a.stat == "probe"] == [0, 1, 2]
    mon.close()
    assert {ident for _, ident, _ in probe.seen} == {threading.get_ident()}


class Laggard(Detector):
    """Returns from the frame of step s only once the training loop has reached step s + lag
    (or is done): the slowest processing the lag allows, whatever the machine's speed."""
    name = "spike"

    def __init__(self, lag: int):
        self.lag, self.seen, self.progress = lag, [], -1
        self.done = threading.Event()

    def check(self, frame):
        deadline = time.monotonic() + 5.0   # the test's own bound
        while (self.progress < frame.step + self.lag and not self.done.is_set()
               and time.monotonic() < deadline):
            time.sleep(0.002)
        self.seen.append(frame.step)
        return []


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_step_start_settles_the_frames_of_the_steps_before_the_lag(tmp_path, lag):
    # processing slower than training: the training thread runs ahead by `lag` frames, no more
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    slow = Laggard(lag)
    mon = sw.watch(model, opt, config=_cfg(processing_lag=lag), run_dir=tmp_path)
    mon.detectors.append(slow)
    g = torch.Generator().manual_seed(1)
    behind = []
    for step in range(6):
        with mon.step(step, batch=torch.randn(4, 8, generator=g)):
            # at this step's start the frames of steps 0 .. step - lag - 1 are processed
            behind.append(step - len(slow.seen))
            slow.progress = step
            loss = model(torch.randn(4, 8, generator=g)).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    slow.done.set()
    mon.close()
    assert behind == [min(step, lag) for step in range(6)]
    assert slow.seen == list(range(6))


def test_a_stuck_detector_does_not_stall_training_and_nothing_read_is_lost(tmp_path, caplog):
    timeout = 0.3
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe, stuck = Probe(), Stuck(at=3)
    mon = sw.watch(model, opt, config=_cfg(processing_timeout=timeout), run_dir=tmp_path)
    mon.detectors[:] = [stuck, probe]
    durations = []
    try:
        with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
            _train(mon, model, opt, 10, durations)
            mon.close()
    finally:
        stuck.release.set()   # the stuck thread returns: its late result must be discarded
    assert stuck.returned.wait(5)
    time.sleep(0.05)
    # no step waited much longer than one stage's timeout (a stalled one would wait 20 s)
    assert max(durations) < timeout + 3.0, durations
    msgs = [r.getMessage() for r in caplog.records if "did not return" in r.getMessage()]
    assert len(msgs) == 1 and "detector 'drift'" in msgs[0] and "step 3" in msgs[0]
    # the frame it was stuck on goes on without it: its records, the other detector's alerts
    assert sorted(set(_stat_steps(tmp_path))) == list(range(10))
    assert [a.step for a in mon.alerts if a.stat == "probe"] == list(range(10))
    assert not any(a.stat == "late" for a in mon.alerts)
    lines = [json.loads(line) for line in open(tmp_path / "alerts.jsonl")]
    assert [a["step"] for a in lines if a["stat"] == "probe"] == list(range(10))
    assert [s for s, _, _ in probe.seen] == list(range(10))   # once each, the stuck frame too


def test_close_is_bounded_by_a_stuck_stage(tmp_path, caplog):
    timeout = 0.3
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stuck = Stuck(at=4)
    mon = sw.watch(model, opt, config=_cfg(processing_timeout=timeout, processing_lag=20),
                   run_dir=tmp_path)
    mon.detectors.append(stuck)
    try:
        _train(mon, model, opt, 6)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
            mon.close()
        took = time.monotonic() - t0
    finally:
        stuck.release.set()
    assert took < timeout + 5.0
    assert any("did not return" in r.getMessage() for r in caplog.records)
    assert sorted(set(_stat_steps(tmp_path))) == list(range(6))


def test_a_failing_detector_warns_once_and_the_frames_go_on(tmp_path, caplog):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe()
    mon = sw.watch(model, opt, config=_cfg(), run_dir=tmp_path)
    bad = Stuck(at=-1, fail_at=2)
    mon.detectors[:] = [bad, probe]
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        _train(mon, model, opt, 5)
        mon.close()
    msgs = [r.getMessage() for r in caplog.records if "a bad detector" in r.getMessage()]
    assert len(msgs) == 1 and "detector 'drift'" in msgs[0] and "step 2" in msgs[0]
    assert [a.step for a in mon.alerts if a.stat == "probe"] == list(range(5))
    assert sorted(set(_stat_steps(tmp_path))) == list(range(5))


def test_close_drains_every_queued_frame(tmp_path):
    # the training thread runs far ahead of a slow detector; close() processes the rest
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe(delay=0.03)
    mon = sw.watch(model, opt, config=_cfg(processing_lag=50), run_dir=tmp_path)
    mon.detectors.append(probe)
    _train(mon, model, opt, 10)
    assert mon.processor.backlog > 0   # frames still waiting when the loop ends
    mon.close()
    assert [s for s, _, _ in probe.seen] == list(range(10))
    assert [a.step for a in mon.alerts if a.stat == "probe"] == list(range(10))
    assert sorted(set(_stat_steps(tmp_path))) == list(range(10))


def test_what_processing_posts_runs_on_the_training_thread_at_a_step_start(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ran: list[tuple[int, int, "int | None"]] = []

    class Poster(Detector):
        name = "spike"

        def check(self, frame):
            step = frame.step
            mon.processor.post(lambda: ran.append((step, threading.get_ident(),
                                                   mon._last_step)))
            return []

    mon = sw.watch(model, opt, config=_cfg(), run_dir=tmp_path)
    mon.detectors.append(Poster())
    _train(mon, model, opt, 6)
    mon.close()
    main = threading.get_ident()
    # the frame of step s (read at its end on the CPU) settles at the start of step s + 2
    # (lag 1), before its schedule is decided; the last ones at close()
    assert ran == [(s, main, s + 2) for s in range(4)] + [(4, main, 5), (5, main, 5)]


@pytest.mark.parametrize("field,value", [("processing", "threads"), ("processing", 1),
                                         ("processing_lag", -1), ("processing_lag", 1.5),
                                         ("processing_timeout", 0), ("processing_timeout", "1")])
def test_bad_processing_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        sw.Config(**{field: value})


def test_a_snapshot_waits_for_the_frames_that_hold_the_capture_ring(tmp_path):
    # the processing runs behind (slow detector, lag 3) and every step is sampled: each step's
    # snapshot needs a ring slot that only the processing of an earlier frame frees
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe(delay=0.3)
    mon = sw.watch(model, opt, config=_cfg(processing_lag=3, capture={
        "triggers": ("critical",), "ring": 2, "snapshot": "every"}), run_dir=tmp_path)
    mon.detectors.append(probe)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(4, 8, generator=g)
        if step == 3:
            x[0, 0] = float("nan")
        with mon.step(step, batch=x):
            loss = model(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    mon.close()
    assert mon.capture.snap.skipped == 0   # no step found every slot held
    crit = [a for a in mon.alerts if a.severity is Severity.CRITICAL]
    assert crit and all(a.step == 3 for a in crit)
    assert crit[0].capture is not None and (tmp_path / crit[0].capture).is_dir()
