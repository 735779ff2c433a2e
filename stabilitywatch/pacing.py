"""The cost budget: how sparse the sampled steps must be for the monitor to cost at most
`Config.cost_budget` of the step time, measured on the run itself.

A mark is recorded at the start of every step: a CUDA event on the model's stream (read once
it has completed, so never a sync) or `time.perf_counter` on the CPU. The span between two
marks is a step's time, the host's work and the GPU's together. The steps fall into three
kinds: sampled, the two steps after a sampled one (its rows are read, then processed, then),
and plain. The extra cost of a sampled step is the sum of the median spans of the sampled and
the after steps, less as many median plain spans (medians: a compile or a hiccup on one step
does not move them); the sentinel's own time is measured by two marks around its launch,
every step. The budget's share left after the sentinel (at least half of it) sets the
cadence: `every` times the smallest whole factor that spreads the sampled steps' extra cost
within it, at most MAX_FACTOR: the cadence the user asked for, at most that much sparser
(a gradual fault's forecast needs its sampled steps).

Only single-process runs pace themselves: the ranks of a torch.distributed job must sample the
same steps (their rows are merged in lockstep), and each would measure its own times.
`every=1` asks for every step and is never stretched; `cost_budget=0` keeps `every` as given.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from typing import Optional

import torch

log = logging.getLogger("stabilitywatch")

MAX_FACTOR = 4       # at most this many times sparser than configured, whatever a step costs
AFTER = ("after1", "after2")   # the kinds of the steps after a sampled one, in order
_KEEP = {"sampled": 5, "after1": 5, "after2": 5, "plain": 31, "sentinel": 31}
_MIN = {"sampled": 3, "after1": 3, "plain": 5}   # after2 counts from 2 spans on
_FLOOR = 0.5         # the share of the budget sampling keeps where the sentinel takes more


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class _Clock:
    """Marks on one CUDA stream (elapsed times read once both marks completed) or the host's
    perf_counter."""

    def __init__(self, device: Optional[torch.device]):
        self.device = device if device is not None and device.type == "cuda" else None
        self._free: list = []

    def mark(self):
        if self.device is None:
            return time.perf_counter()
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def ready(self, m) -> bool:
        return self.device is None or m.query()

    def seconds(self, a, b) -> float:
        if self.device is None:
            return b - a
        return a.elapsed_time(b) * 1e-3

    def free(self, m) -> None:
        if self.device is not None and len(self._free) < 64:
            self._free.append(m)


class Pacer:
    """Times the steps and gives the factor that stretches the schedule's cadences."""

    def __init__(self, budget: float, every: int, device: Optional[torch.device],
                 world_size: int = 1):
        self.on = budget > 0 and every > 1 and world_size == 1
        self.budget, self.every = budget, every
        self.factor = 1
        self.changes: list[dict] = []         # for run.json: where the cadence changed and why
        self._clock = _Clock(device)
        self._spans = {k: collections.deque(maxlen=n) for k, n in _KEEP.items()}
        self._open: collections.deque = collections.deque()   # (mark, kind of the step it starts)
        self._kind: Optional[str] = None     # the kind of the step begun last
        self._step = 0
        self._sent: collections.deque = collections.deque()   # (start, stop) around the sentinel
        self._sent_start = None

    # -- the training thread, once per step and around the sentinel ---------------------------
    def begin(self, step: int) -> None:
        """The start of a step: the end of the step before."""
        if not self.on:
            return
        self._step = step
        try:
            self._open.append([self._clock.mark(), self._kind])
            self._read()
        except Exception as e:   # timing is an aid: a clock that fails switches pacing off
            self._off(e)

    def sampled(self, sampled: bool) -> None:
        """Whether the step just begun reads tensors (called after the schedule decided)."""
        if not self.on:
            return
        prev, kind = self._kind, "plain"
        if sampled:
            kind = "sampled"
        elif prev == "sampled":
            kind = AFTER[0]
        elif prev in AFTER[:-1]:
            kind = AFTER[AFTER.index(prev) + 1]
        self._kind = kind
        if self._open:
            self._open[-1][1] = kind   # the span from this mark on is this step's

    def sentinel_start(self) -> None:
        if self.on:
            try:
                self._sent_start = self._clock.mark()
            except Exception as e:
                self._off(e)

    def sentinel_stop(self) -> None:
        if self.on and self._sent_start is not None:
            try:
                self._sent.append((self._sent_start, self._clock.mark()))
            except Exception as e:
                self._off(e)
            self._sent_start = None

    # -- measurements -------------------------------------------------------------------------
    def _read(self) -> None:
        clock, changed = self._clock, False
        while len(self._open) >= 2 and clock.ready(self._open[1][0]):
            (a, kind), (b, _) = self._open.popleft(), self._open[0]
            if kind is not None:
                self._spans[kind].append(clock.seconds(a, b))
                changed = changed or kind in AFTER
            clock.free(a)
        while self._sent and clock.ready(self._sent[0][1]):
            a, b = self._sent.popleft()
            self._spans["sentinel"].append(clock.seconds(a, b))
            clock.free(a)
            clock.free(b)
        if changed:
            self._decide()

    def _decide(self) -> None:
        sp = self._spans
        if any(len(sp[k]) < n for k, n in _MIN.items()):
            return
        plain = _median(sp["plain"])
        if plain <= 0:
            return
        kinds = ["sampled"] + [k for k in AFTER if len(sp[k]) >= 2]
        extra = sum(_median(sp[k]) for k in kinds) - len(kinds) * plain
        sentinel = _median(sp["sentinel"]) if sp["sentinel"] else 0.0
        left = max(self.budget - sentinel / plain, _FLOOR * self.budget)
        # a hair under a whole number is that number: spans are sums of float times
        want = math.ceil(extra / (left * plain * self.every) - 1e-6) if extra > 0 else 1
        factor = max(1, min(want, MAX_FACTOR))
        if factor != self.factor:
            self.factor = factor
            note = {"step": self._step, "every": self.every * factor, "sampled_extra_ms": round(extra * 1e3, 3),
                    "step_ms": round(plain * 1e3, 3), "sentinel_ms": round(sentinel * 1e3, 3),
                    "cost_budget": self.budget}
            self.changes.append(note)
            log.info("stabilitywatch: statistics every %d steps: a sampled step costs %.2f ms "
                     "more than a %.2f ms step (sentinel %.2f ms), cost budget %g",
                     self.every * factor, extra * 1e3, plain * 1e3, sentinel * 1e3, self.budget)

    def _off(self, e: Exception) -> None:
        self.on, self.factor = False, 1
        log.warning("stabilitywatch: timing the steps failed (%s: %s); statistics stay at "
                    "every %d steps", type(e).__name__, e, self.every)
