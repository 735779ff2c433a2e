"""What happens to a frame on the processing thread (processing.py): the detectors, grouping
into incidents, the guard's notes, capture, the stats records and the sinks, each a stage of
its own. A part of the Monitor (monitor.py), kept apart from the step plumbing that runs on the
training thread."""
from __future__ import annotations

import dataclasses
import operator

from .alert import SCHEMA_VERSION
from .detectors.base import idle
from .incidents import CAUSES, change_records, is_change_point
from .stats.buffer import StatsFrame


class FrameHandling:
    """The Monitor's frame handling; the attributes it reads are the Monitor's."""

    def _handle(self, frame: StatsFrame) -> None:
        """Detectors, incidents, capture, records and sinks for one frame: on the processing
        thread (processing.py), each part a stage of its own."""
        run = self.processor.stage
        step = frame.step   # _process gave a merged frame this rank's sentinel
        if getattr(frame, "rerun", False):   # only where the values first went bad
            alerts = [dataclasses.replace(a, extra={**a.extra, "rerun": True})
                      for d in self.detectors if d.name == "nonfinite"
                      for a in run(f"detector '{d.name}'", d.check, frame, key=("det", id(d)),
                                   default=[], step=step) if self.cooldown.allow(a)]
            alerts, _ = run("grouping into incidents", self.incidents.group, frame, alerts,
                            default=(alerts, []), step=step)   # the skipped step's incident
            self._emit(self._capture(frame, alerts))
            return
        # change points are evidence for incidents, not alerts of their own, and each bad write
        # is an event of its own: no cooldown for either
        alerts = [a for det in self._detectors_for(frame)
                  for a in run(f"detector '{det.name}'", det.check, frame, key=("det", id(det)),
                               default=[], step=step)
                  if is_change_point(a) or a.detector in CAUSES or self.cooldown.allow(a)]
        changes: list = []
        if alerts:   # without alerts, the next two stages give ([], []) and [] and change nothing
            alerts = self.dist.annotate(frame, alerts)   # which ranks hold a merged row's NaN/Inf
            # incidents: roots first (the order sinks receive is alerts.jsonl's file order);
            # change points in no incident go to stats.jsonl
            alerts, changes = run("grouping into incidents", self.incidents.group, frame, alerts,
                                  default=(alerts, []), step=step)
            # "step skipped"; escalation (posted to the training thread)
            alerts = run("the guard's notes and escalation", self.control.on_alerts, frame,
                         alerts, default=alerts, step=step)
        alerts = self._capture(frame, alerts)
        recs = run("stats records", self._records, frame, default=[], step=step)
        if changes and recs:
            recs += change_records(frame, changes, {k: v for k, v in recs[0].items()
                                                    if k not in ("module", "tensor", "stats")})
        self._emit(alerts)
        self.sinks.log(recs)

    def _detectors_for(self, frame: StatsFrame) -> list:
        """The detectors to run on a frame: those not idle on its keys (worked out once per row
        set and list of detectors; a detector added to `self.detectors` later is seen)."""
        dets, rs = self.detectors, frame.row_set
        got = self._busy.get(rs)
        if got is None or len(got[0]) != len(dets) or not all(map(operator.is_, got[0], dets)):
            if got is None and len(self._busy) >= 8:
                self._busy.pop(next(iter(self._busy)))
            got = self._busy[rs] = (tuple(dets), [d for d in dets if not idle(d, rs.keys)])
        return got[1]

    def _emit(self, alerts: list) -> None:
        self.processor.check_live()   # a replaced processing thread writes nothing
        for a in alerts:
            self.alerts.append(a)
            self.sinks.alert(a)

    def _capture(self, frame: StatsFrame, alerts: list) -> list:
        # writes a bundle when asked for; sets Alert.capture
        if self.capture is None:
            return alerts
        return self.processor.stage("capture", self.capture.on_frame, frame, alerts,
                                    default=alerts, step=frame.step)

    def _records(self, frame: StatsFrame) -> list[dict]:
        base = {"schema": SCHEMA_VERSION, "step": frame.step, "rank": frame.rank,
                "world_size": frame.world_size, **self.dist.record_fields(frame)}
        if self.schedule.escalated(frame.step):
            base["escalated"] = True
        return self._frame_records(frame, base)
