"""Re-running a skipped step in place (`Config.guard.rerun_skipped`, with the guard and `step_fn`).

When the guard skipped a step, the weights and optimizer state are still those of its start
until the next optimizer step. At that step's end the monitor waits for its sentinel (the one
host wait per step this option costs: the rows and the sentinel of the step), and when the step
was skipped it runs
`step_fn(model, batch)` and its backward again, as a monitored step with every configured role
read and no optimizer step: the re-run's frame (same step number, `extra["rerun"] = True` on its
alerts) names the forward module where the values first went bad, which the step's own frame
(the loss and the gradients only, on an unsampled step) could not. The gradients the training
loop holds are put back afterwards. Single process only (a re-run forward under DDP or FSDP
would enter collectives that the other ranks do not).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Optional

log = logging.getLogger("stabilitywatch")


def resolve(path: str) -> Callable:
    mod_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path!r} is not callable")
    return obj


class InPlaceRerun:
    def __init__(self, monitor: Any):
        self.mon = monitor
        self.fn: Optional[Callable] = None
        self.running = False
        self.reruns: list[int] = []          # steps re-run (tests, records)
        self._batch: Any = None
        self._frames: set[int] = set()      # steps whose re-run frame is still to come
        cfg = monitor.config
        if not cfg.guard.rerun_skipped:
            return
        why = None
        if monitor.world_size > 1:
            why = "it runs in single-process jobs only"
        elif monitor.step_fn is None:
            why = "watch() was given no step_fn"
        elif monitor.control.guard is None:
            why = "the guard is off"
        else:
            try:
                self.fn = resolve(monitor.step_fn)
            except Exception as e:
                why = f"step_fn {monitor.step_fn!r} does not import ({type(e).__name__}: {e})"
        if why:
            log.warning("stabilitywatch: guard.rerun_skipped is off: %s", why)

    @property
    def on(self) -> bool:
        return self.fn is not None

    def begin(self, batch: Any) -> None:
        if self.on and not self.running:
            self._batch = batch

    def wait(self, pending) -> None:
        """After the step's rows and sentinel were queued for the host: wait for them, so that
        the frame is read now, before any further optimizer step."""
        if self.on and not self.running and pending is not None:
            for _, _, ev in pending.copies:
                if ev is not None:
                    ev.synchronize()   # sync-ok: the cost of rerun_skipped, one wait per step
            if pending.sentinel is not None:
                pending.sentinel.wait()

    def after_frames(self, step: int) -> None:
        """After the step's frame was read: re-run it when the guard skipped it."""
        batch, self._batch = self._batch, None
        if not self.on or self.running:
            return
        sent = self.mon.buffer.sentinel_of(step)
        if sent is None or not sent.skipped:
            return
        self._rerun(step, batch)

    def _rerun(self, step: int, batch: Any) -> None:
        mon = self.mon
        params = [p for _, _, p in mon.taps.params]
        grads = [p.grad for p in params]
        self.running = True
        self._frames.add(step)
        try:
            for p in params:
                p.grad = None
            mon.schedule.force_next()
            with mon.step(step, batch=batch):
                loss = self.fn(mon.model, batch)
                loss.backward()
                mon.observe_loss(loss)
            self.reruns.append(step)
        except Exception as e:
            log.warning("stabilitywatch: re-running skipped step %d failed (%s: %s); no "
                        "further re-runs", step, type(e).__name__, e)
            self.fn = None
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            self.running = False

    def is_rerun_frame(self, frame) -> bool:
        """True for the frame of a re-run (the step's own frame was read before it began)."""
        if frame.step in self._frames:
            self._frames.discard(frame.step)
            return True
        return False
