"""Frame processing off the training thread (`Config.processing="thread"`).

At a step end the training thread only reads the frames whose copies have landed (and, in a
distributed run, takes part in the flush collective) and queues them here. One thread of the
monitor's own runs, frame after frame in step order, what the Monitor's `_handle` does with a
frame: detectors, incidents, capture decisions, record formation, the hand-off to the sinks.

What has to happen on the training thread (anything that changes the schedule, anything that
reads live tensors) is posted by the processing thread with `post(fn)` and run at a step start
(`at_begin`), at a step the lag fixes, whatever the processing thread's speed:

- lag: at the start of step k every frame read at the end of step k-1-lag or earlier (lag =
  `Config.processing_lag`) has been processed, and what those frames posted runs then, before
  the step's schedule is decided. With lag 1 an escalation asked for by an alert in the frame
  read at the end of step s opens its window at step s+2 (inline processing: s+1). When
  processing falls further behind, the step start waits for it; so at most lag + 1 step ends'
  frames wait here (the bound of the queue) and nothing read is ever dropped.
- stuck or failing: every stage of a frame (one detector, the grouping into incidents, the
  capture decision, the records) runs through `stage()`. A stage that raises gives one warning
  naming it and the frame goes on. A stage that does not return within
  `Config.processing_timeout` seconds (seen by the training thread while it queues frames or
  waits) is switched off for the rest of the run with one warning naming it; a fresh thread
  takes the frame over at the next stage (stages done are not run again) and the stuck thread's
  results are discarded whenever it returns. So no wait of the training thread lasts longer than
  the timeout per stage, and the frames' records and the other stages' alerts are kept.
- `drain()` (close) processes every frame queued, with the same bound, then runs what is posted.

Inline (`processing="inline"`: debugging, or a step-by-step reading of `mon.alerts`) runs the
same stages on the training thread at the step end, with no timeout; posts run at the next
step start.

The processing thread yields the GIL (`time.sleep(0)`) at the end of a stage once it has run
for YIELD_AFTER seconds since its last yield: a training thread waiting for the GIL gets it then,
or after the interpreter's switch interval (5 ms) if that comes first. A yield is a system call
that a busy machine answers by running another process first (22 us of CPU and 0.2 ms of wall
time each on the 2-core CI machine under load), so short stages (a loss-only frame's are a few
microseconds) do not pay one each. The stages work on whole frames with numpy
(benchmarks/bench_frame.py: README "Frame processing, off the training thread").
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

log = logging.getLogger("stabilitywatch")

THREAD_NAME = "stabilitywatch-frames"
IDLE_EXIT = 5.0   # seconds idle after which the thread ends (the next frame starts a new one)
YIELD_AFTER = 0.0005   # seconds of processing between two yields of the GIL (at stage ends)


class _Abandoned(BaseException):
    """Unwinds a processing thread that was replaced while a stage of it was stuck."""


class Processor:
    def __init__(self, handle: Callable[[Any], None], *, threaded: bool = True, lag: int = 1,
                 timeout: float = 10.0):
        self._handle = handle
        self.threaded = threaded
        self.lag = lag if threaded else 0
        self.timeout = float(timeout)
        self.disabled: set = set()            # keys of stages switched off (stuck)
        self.waited = 0.0                     # seconds the training thread waited, in all
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()     # (tag, frame)
        self._requests: collections.deque = collections.deque()  # (tag, fn)
        self._ends = 0                        # hand-offs so far (one per step end, and close)
        self._current: Optional[list] = None  # [tag, frame, memo] of the frame in progress
        self._call: Optional[tuple] = None    # (key, label, started, step) of the stage running
        self._thread: Optional[threading.Thread] = None
        self._abandoned: set = set()
        self._warned: set = set()
        self._stopped = False
        self._inline_tag = 0
        self._yielded = 0.0                   # perf_counter at the processing thread's last yield

    # -- the training thread's side ------------------------------------------------------------
    def submit(self, frames: list, inline: bool = False) -> None:
        """Queue the frames read at one step end (or at close), in step order. inline: process
        them here, after every frame queued before them (a rare step whose capture needs this
        thread before its alerts go out)."""
        if inline and self.threaded and not self._stopped:
            self.wait_all()
        self._ends += 1
        tag = self._ends
        if not self.threaded or self._stopped or inline:
            for frame in frames:
                self._inline(tag, frame)
            return
        with self._cond:
            if frames:   # a step end that read no frame wakes no thread
                self._queue.extend((tag, f) for f in frames)
                if self._thread is None:
                    self._start(None)
                self._cond.notify_all()
            self._watch()

    def at_begin(self) -> None:
        """At a step start: wait until the frames of the step ends before the last `lag` ones
        are processed, then run what they posted."""
        need = self._ends - self.lag
        if self.threaded:
            self._wait(lambda: self._through() >= need)
        if self._requests:   # what the frames through `need` posted is in by now
            self._run_requests(need)

    def wait_all(self) -> None:
        """Wait until every frame queued so far is processed (bounded as at_begin)."""
        if self.threaded:
            self._wait(lambda: self._through() >= self._ends)

    def drain(self) -> None:
        """At close: process every frame queued, stop the thread, run everything posted.
        Later submits are processed inline."""
        self.wait_all()
        with self._cond:
            self._stopped = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread not in self._abandoned:
            thread.join(timeout=min(1.0, self.timeout))
        self._run_requests(None)

    @property
    def backlog(self) -> int:
        """Frames queued or in progress."""
        with self._cond:
            return len(self._queue) + (self._current is not None)

    # -- the processing thread's side ----------------------------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the training thread at the step start that settles the frame being
        processed (see `at_begin`); from outside a frame, at the next step start."""
        cur = self._current
        if cur is not None and threading.current_thread() is self._thread:
            tag = cur[0]
        else:
            tag = self._inline_tag if not self.threaded else -(1 << 62)   # any step start
        with self._cond:
            self._requests.append((tag, fn))

    def stage(self, label: str, fn: Callable, *args, key: Any = None, default: Any = None,
              step: Optional[int] = None) -> Any:
        """fn(*args) as one stage of the frame in progress: `default` when the stage is
        switched off or raises (one warning per stage); its result again when a thread that
        takes the frame over reaches it a second time."""
        key = label if key is None else key
        if key in self.disabled:
            return default
        me = threading.current_thread()
        if me in self._abandoned:
            raise _Abandoned()
        mine = me is self._thread
        memo = self._current[2] if mine and self._current is not None else None
        if memo is not None and key in memo:
            return memo[key]
        if mine:
            self._call = (key, label, time.monotonic(), step)
        try:
            out = fn(*args)
        except Exception as e:
            self.warn_once(("raised", key), f"{label} failed on step {step} "
                           f"({type(e).__name__}: {e}); the frames go on without its result")
            out = default
        finally:
            if mine:
                with self._cond:
                    if me in self._abandoned:
                        raise _Abandoned()
                    self._call = None
        if memo is not None:
            memo[key] = out
        if mine:
            now = time.perf_counter()
            if now - self._yielded >= YIELD_AFTER:
                time.sleep(0)  # hand the GIL to the training thread if it waits for it
                self._yielded = time.perf_counter()
        return out

    def check_live(self) -> None:
        """Raise in a processing thread that was replaced (before it writes anything)."""
        me = threading.current_thread()
        if me in self._abandoned:
            raise _Abandoned()

    def warn_once(self, key: Any, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("stabilitywatch: %s", msg)

    # -- internals -----------------------------------------------------------------------------
    def _inline(self, tag: int, frame: Any) -> None:
        self._inline_tag = tag
        try:
            self._handle(frame)
        except Exception as e:
            self.warn_once("frame", f"processing step {getattr(frame, 'step', '?')} failed "
                           f"({type(e).__name__}: {e})")

    def _through(self) -> int:
        # the last hand-off whose frames are all processed (called holding _cond)
        tags = [self._queue[0][0]] if self._queue else []
        if self._current is not None:
            tags.append(self._current[0])
        return min(tags) - 1 if tags else self._ends

    def _wait(self, done: Callable[[], bool]) -> None:
        t0 = None
        with self._cond:
            while not done():
                if t0 is None:
                    t0 = time.monotonic()
                self._watch()
                if done():
                    break
                self._cond.wait(self._until_overdue())
        if t0 is not None:
            self.waited += time.monotonic() - t0

    def _until_overdue(self) -> float:
        call = self._call
        if call is None:
            return min(self.timeout, 0.5)
        return max(0.001, call[2] + self.timeout - time.monotonic() + 0.001)

    def _watch(self) -> None:
        # called holding _cond, on the training thread
        call = self._call
        if call is not None and time.monotonic() - call[2] > self.timeout:
            key, label, _, step = call
            self.disabled.add(key)
            self._takeover(f"{label} did not return within {self.timeout:g} s on step {step}; "
                           f"it is switched off for the rest of the run")
        elif self._queue or self._current is not None:
            if self._thread is None:
                self._start(None)
            elif not self._thread.is_alive():
                self._takeover("the frame processing thread ended")

    def _takeover(self, why: str) -> None:
        log.warning("stabilitywatch: frame processing: %s; a fresh thread goes on with the "
                    "frames (nothing read is lost, training goes on)", why)
        if self._thread is not None:
            self._abandoned.add(self._thread)
        self._call = None
        self._start(self._current)

    def _start(self, resume: Optional[list]) -> None:
        self._thread = threading.Thread(target=self._run, args=(resume,), name=THREAD_NAME,
                                        daemon=True)
        self._thread.start()

    def _run(self, resume: Optional[list]) -> None:
        me = threading.current_thread()
        try:
            if resume is not None:
                self._one(resume)
            while True:
                with self._cond:
                    while not self._queue and not self._stopped and me not in self._abandoned:
                        if not self._cond.wait(IDLE_EXIT) and not self._queue:
                            # an idle monitor (or one never closed) keeps no thread
                            if self._thread is me:
                                self._thread = None
                            return
                    if me in self._abandoned or not self._queue:
                        return
                    tag, frame = self._queue.popleft()
                    self._current = cur = [tag, frame, {}]
                self._one(cur)
        except _Abandoned:
            return

    def _one(self, cur: list) -> None:
        me = threading.current_thread()
        self._yielded = time.perf_counter()   # it has just taken the GIL back (from a wait)
        try:
            self._handle(cur[1])
        except _Abandoned:
            raise
        except BaseException as e:  # SystemExit in a thread would end it silently
            self.warn_once("frame", f"processing step {getattr(cur[1], 'step', '?')} failed "
                           f"({type(e).__name__}: {e})")
        with self._cond:
            if me in self._abandoned:
                raise _Abandoned()
            self._current = None
            self._cond.notify_all()

    def _run_requests(self, through: Optional[int]) -> None:
        while True:
            with self._cond:
                if not self._requests or (through is not None and self._requests[0][0] > through):
                    return
                _, fn = self._requests.popleft()
            try:
                fn()
            except Exception as e:
                self.warn_once(("request", getattr(fn, "__qualname__", repr(fn))),
                               f"a step-start task of frame processing failed "
                               f"({type(e).__name__}: {e})")
