"""What the Monitor does with the sentinel beyond the frame: the step's device flag (reduced
across ranks under torch.distributed), the guard that skips a non-finite step, and escalation
(full sampling for a window after a tripped sentinel or a warning-or-worse alert).

Ranks must escalate on the same step. Under the lockstep coordinator every rank reads the same
step ends' frames at the same flush, and with the guard on each frame's sentinel carries the
cross-rank flag (the same value everywhere): escalation follows that flag alone there, not
alerts (rank 0 decides those alone). Other multi-rank runs do not escalate (logged): a
collective every step only for escalation would stall the ranks still running when one leaves.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from .alert import Alert, Severity
from .guard import CrossRankFlag, Guard

log = logging.getLogger("stabilitywatch")


class SentinelControl:
    def __init__(self, monitor: Any):
        self.mon = mon = monitor
        cfg = mon.config
        self.store = mon.buffer.sentinel
        self.guard: Optional[Guard] = None
        if cfg.guard.on_nonfinite == "skip":
            if mon.optimizer is None:
                log.warning("stabilitywatch: guard.on_nonfinite='skip' needs the optimizer passed "
                            "to watch(); without it no step is skipped")
            else:
                # captures read the skipped step's state after it: the latch keeps it (guard.py)
                hold = bool(cfg.capture.triggers) and cfg.capture.snapshot.value != "off"
                self.guard = Guard(mon.optimizer, hold=hold)
                if not self.guard.fused:
                    log.info("stabilitywatch: the guard reads its flag on the host once per step "
                             "(%s is not a fused torch.optim optimizer)",
                             type(self.guard.opt).__name__)
        self.multi = mon.world_size > 1
        self.lockstep = bool(getattr(mon.dist, "active", False))
        self.escalate = cfg.escalate_steps > 0 and cfg.sentinel
        # ranks escalate on the same step only from the cross-rank flag read at the lockstep
        # flush; that flag is reduced every step, which the guard needs anyway
        self.xrank: Optional[CrossRankFlag] = None
        if self.multi and cfg.sentinel and self.guard is not None:
            self.xrank = CrossRankFlag(self.store.keys)
        if self.multi and self.escalate and (self.xrank is None or not self.lockstep):
            self.escalate = False
            log.info("stabilitywatch: escalation is off in this multi-rank run: ranks switch "
                        "on the same step only from the guard's cross-rank flag (needs "
                        "guard.on_nonfinite='skip') read at lockstep flushes (not "
                        "dist.mode='per_rank' with dist.divergence=False)")
        elif self.multi and self.escalate:
            log.info("stabilitywatch: multi-rank run: escalation follows the guard's cross-rank "
                     "gradient flag (alerts are decided on one rank and do not escalate)")
        self._device = next((p.device for _, _, p in mon.taps.params), torch.device("cpu"))
        self._was_tripped = False
        self.read_through: Optional[int] = None   # the latest step whose frame was handled
        self._skip_seen: Optional[int] = None      # the latest skipped step not let go yet
        mon.sentinel.after_write.append(self._after_write)
        if self.guard is not None:
            mon.sentinel.after_step_fns.append(self._after_step)

    # -- hot path ------------------------------------------------------------------------------
    def _after_write(self, opt, written: bool) -> None:
        if self.xrank is None and (self.guard is None or opt is None):
            return
        if written:
            flag = self.store.flag(self._device)
        else:
            flag = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.xrank is not None:
            try:
                code = self.xrank.reduce(flag, self.store.bad_counts(flag.device)
                                         if written else None)
                self.store.set_reduced_flag(code)
                flag = (code[0] > 0).to(torch.float32)
            except Exception as e:   # a rank gone: decide locally from now on
                self.xrank, self.escalate = None, False
                log.warning("stabilitywatch: the cross-rank gradient flag failed (%s: %s); the "
                            "guard decides from this rank's gradients alone and escalation is "
                            "off", type(e).__name__, e)
        if self.guard is not None and opt is not None:
            try:
                self.guard.before_step(flag, self.mon._step)
                self.store.guarded = True
            except Exception as e:
                self.guard = None
                log.warning("stabilitywatch: the guard failed (%s: %s); it is switched off, "
                            "steps are no longer skipped", type(e).__name__, e)

    def _after_step(self, opt) -> None:
        if self.guard is not None:
            self.guard.after_step()

    # -- off the hot path ----------------------------------------------------------------------
    def on_polled(self) -> None:
        """After each read of frames: escalate on a sentinel that went from clean to tripped."""
        for sent in self.store.drain_read():
            # every rank reads the same sentinels (frames may reach rank 0 alone): the guard's
            # latch is let go from these, on the same step everywhere
            self.read_through = sent.step if self.read_through is None else max(
                self.read_through, sent.step)
            if sent.skipped or sent.any_rank_bad:
                self._skip_seen = sent.step
            tripped = bool(sent.any_rank_bad) if self.multi else sent.tripped
            if tripped and not self._was_tripped and self.escalate:
                self._escalate(f"non-finite gradients at step {sent.step}")
            self._was_tripped = tripped

    def release(self, through: Optional[int]) -> None:
        """At a step boundary on the training thread, once captures took their copies: the
        guard's latch lets go of skipped steps through `through` (frames handled)."""
        if self.guard is None or self._skip_seen is None or through is None:
            return
        if through >= self._skip_seen:
            self._skip_seen = None
        try:
            self.guard.release(through)
        except Exception as e:   # the latch lets go by itself after HOLD_LIMIT steps
            log.warning("stabilitywatch: releasing the guard's latch failed (%s: %s)",
                        type(e).__name__, e)

    def on_alerts(self, frame, alerts: list[Alert]) -> list[Alert]:
        """The step-skipped note on a frame's alerts; an escalation asked for by the worst."""
        sent = frame.sentinel
        if sent is not None and sent.skipped:
            note = ("; step skipped by the guard: its update was not applied (weights and "
                    "optimizer state after it are those of its start)")
            alerts = [dataclasses.replace(a, message=a.message + note,
                                          extra={**a.extra, "skipped": True}) for a in alerts]
        if self.escalate and not self.multi:
            worst = max(alerts, key=lambda a: a.severity.rank, default=None)
            if worst is not None and worst.severity.rank >= Severity.WARNING.rank:
                why = (f"{worst.detector} {worst.severity.value} at step {worst.step} "
                       f"({worst.module or '<model>'} {worst.tensor})")
                # this runs on the processing thread: the schedule changes on the training
                # thread, at the step start that settles this frame (processing.py, the lag)
                self.mon.processor.post(lambda: self._escalate(why))
        return alerts

    def _escalate(self, why: str) -> None:
        if self.mon.schedule.escalate(why):
            log.info("stabilitywatch: escalation: the next %d steps read every role (%s)",
                     self.mon.config.escalate_steps, why)
