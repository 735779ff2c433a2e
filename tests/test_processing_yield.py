"""The processing thread hands the GIL over at stage ends once it has run a while, not after
every stage: a yield is a system call that a busy machine answers by running another process."""
import threading
import time

from stabilitywatch import processing
from stabilitywatch.processing import THREAD_NAME, Processor


def _yields(monkeypatch, stage_seconds: float, stages: int) -> int:
    calls = []
    real = time.sleep

    def spy(s):
        if s == 0 and threading.current_thread().name == THREAD_NAME:
            calls.append(s)
        real(s)

    monkeypatch.setattr(processing.time, "sleep", spy)

    def busy():
        end = time.perf_counter() + stage_seconds
        while time.perf_counter() < end:
            pass

    def handle(frame):
        for k in range(stages):
            proc.stage(f"stage {k}", busy)

    proc = Processor(handle, threaded=True, timeout=30.0)
    proc.submit([object()])
    proc.wait_all()
    proc.drain()
    return len(calls)


def test_short_stages_do_not_yield_one_by_one(monkeypatch):
    assert _yields(monkeypatch, 0.0, 40) <= 2


def test_long_stages_yield_at_their_ends(monkeypatch):
    n = _yields(monkeypatch, 2 * processing.YIELD_AFTER, 6)
    assert n >= 5
