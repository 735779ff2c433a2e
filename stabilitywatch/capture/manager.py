"""Capture inside a Monitor: what is kept per step, and a bundle for every step whose alerts ask
for one (capture/state.py says what the default keeps).

`begin` runs at the step start (hot path: the step's batch reference and RNG states; under the
"sampled"/"every" policies the start-of-step snapshot too). `on_frame` runs when a step's
statistics have been read and its alerts decided, on whatever thread reads frames: it only
decides what the bundle holds, names it on the alerts and queues it. `at_boundary` runs on the
training thread at each step boundary: it takes the queued copies (tensor copies only ever
happen there, ahead of the next optimizer step) and writes the bundles whose escalation window's
rows have been read. A failure here never reaches training: one warning, and the alert is
recorded with `capture: null`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..alert import SCHEMA_VERSION, Alert
from ..incidents import manifest_incidents
from .contents import (batch_and_rng, batch_bytes, device_info, frame_rows, note, optim_meta,
                       stat_names, versions)
from .context import CaptureContext
from .policy import Retention, SnapshotPolicy, matches, triggers
from .snapshot import Snapshotter
from .state import (HOST_FRACTION, StateCopy, StepRecord, StepRing, to_host, copy_state,
                    host_budget, state_nbytes, with_hyper)
from .treeio import config_to_json, jsonable, rows_to_json
from .writer import BUNDLE_SCHEMA, KIND, Store, write_bundle, write_rows

log = logging.getLogger("stabilitywatch")

@dataclasses.dataclass
class _Pending:
    """A bundle decided on, waiting for its copies (next boundary) and its escalated rows."""
    step: int
    name: str
    source: Optional[str]            # "slot" | "held" | "current" | None (no weights)
    lacks: list[str]
    why: Optional[str]
    record: Optional[StepRecord]
    manifest: dict                   # all but the tensors and what is filled in later
    after: int                       # escalated rows come from frames of later steps
    seq: int = -1                    # the snapshot slot it reads ("slot")
    held: Optional[tuple[int, int]] = None
    state: Optional[StateCopy] = None
    taken: bool = False
    claimed: bool = False            # the thread that decided on it takes and writes it
    escalated: list = dataclasses.field(default_factory=list)
    done: bool = False
    batch_tensors: Optional[dict] = None
    rng_tensors: Optional[dict] = None
    path: Optional[Path] = None      # where it was written


class CaptureManager:
    def __init__(self, ctx: CaptureContext):
        cfg = ctx.config
        self.ctx = ctx
        self.triggers = triggers(cfg.capture.triggers)
        self.policy = cfg.capture.snapshot
        root = Path(cfg.capture.dir)
        self.root = root if root.is_absolute() else ctx.run_dir / root
        self.store = Store(self.root, cfg.capture.max, cfg.capture.max_bytes, cfg.capture.retention)
        self.snap = Snapshotter(ctx.model, ctx.optimizer, ring=cfg.capture.ring,
                                target=cfg.capture.snapshot_to)
        self.ring = StepRing(ctx.optimizer)
        self.written: list[Path] = []
        # what was copied of the weights and optimizer state (tests and benchmarks read it):
        # (step, bytes) of each bundle's copy of the current state, and the snapshots' total
        self.copies: list[tuple[int, int]] = []
        self.snapshot_bytes = 0
        self._names = {id(p): n for n, p in ctx.model.named_parameters()}
        self._begun: list[tuple[int, int]] = []   # (step, seq) of recent step starts
        self._seq = 0
        self._pending: list[_Pending] = []
        self._held: Optional[StateCopy] = None
        self._decided: Optional[int] = None       # the latest step whose frame was decided
        self._captured: set[int] = set()
        self._lock = threading.Lock()              # on_frame may run on another thread
        self._thread = threading.get_ident()       # the training thread (watch() runs there)
        self._warned: set[str] = set()

    # -- hot path ------------------------------------------------------------------------------
    def begin(self, step: int, batch: Any, sampled: bool) -> None:
        seq, self._seq = self._seq, self._seq + 1
        self._begun = self._begun[-63:] + [(step, seq)]
        if self.policy is SnapshotPolicy.OFF or self.store.full:
            return                        # nothing could be written: do not pay for it
        try:
            with self._lock:
                self.ring.add(step, seq, batch)
        except Exception as e:
            self._warn("ring", f"the step's RNG states could not be kept ({type(e).__name__}: "
                               f"{e}); bundles are written without them")
        if self.policy is SnapshotPolicy.AUTO or (self.policy is SnapshotPolicy.SAMPLED
                                                  and not sampled):
            return
        try:
            slot = self.snap.take(step, batch, seq)
            if slot is not None:
                self.snapshot_bytes += slot.nbytes
        except Exception as e:  # never let a snapshot stop training
            self.snap.disabled = True
            self._warn("snap", f"start-of-step snapshots switched off ({type(e).__name__}: {e})")

    def ring_full(self, sampled: bool) -> bool:
        """True when this step would take a start-of-step snapshot and every slot of the ring
        is still held (by frames not yet decided on)."""
        takes = self.policy is SnapshotPolicy.EVERY or (sampled and
                                                         self.policy is SnapshotPolicy.SAMPLED)
        return (takes and not self.snap.disabled
                and all(s.step is not None for s in self.snap.slots))

    # -- any thread: decide and queue ----------------------------------------------------------
    def on_frame(self, frame: Any, alerts: list[Alert]) -> list[Alert]:
        """The alerts of one step, with `capture` set when a bundle is queued for it."""
        now: Optional[_Pending] = None
        with self._lock:
            try:
                self._collect(frame)
                if self.policy is not SnapshotPolicy.OFF and frame.step not in self._captured \
                        and any(
                            matches(self.triggers, a.detector, a.severity.value) for a in alerts):
                    alerts = self._decide(frame, alerts)
                    last = self._pending[-1] if self._pending else None
                    # a copy of the current state needs the training thread (at a boundary);
                    # a snapshot slot, the held state or no state at all can be written here
                    if last is not None and last.step == frame.step and (
                            threading.get_ident() == self._thread or last.source != "current"):
                        now, last.claimed = last, True
            except Exception as e:
                self._warn("error", f"capture of step {frame.step} failed ({type(e).__name__}: "
                                    f"{e}); training goes on, the alert is recorded without a "
                                    f"capture")
            finally:
                self._decided = frame.step if self._decided is None else max(self._decided,
                                                                               frame.step)
                seq = next((q for s, q in reversed(self._begun) if s == frame.step), None)
                if seq is not None:
                    self.ring.release_through(seq)
                    self.snap.release_through(seq, keep={p.seq for p in self._pending
                                                         if p.source == "slot" and not p.taken})
        if now is not None:
            # written before its alerts go out (a failed write: capture null): on the training
            # thread frames are handled between steps, a boundary already; on the processing
            # thread only bundles that need no copy of live tensors get here
            self._take(now)
            if not self._write(now):
                alerts = [dataclasses.replace(a, capture=None) for a in alerts]
        return alerts

    def _collect(self, frame: Any) -> None:
        """The escalated steps' rows, for the bundles still waiting for them."""
        limit = self.ctx.config.escalate_steps
        for p in self._pending:
            if p.done or frame.step <= p.after:
                continue
            if self.ctx.escalated(frame.step) and len(p.escalated) < limit:
                p.escalated.append(frame_rows(frame))
            p.done = p.done or len(p.escalated) >= limit or not self.ctx.escalated(frame.step)

    def _decide(self, frame: Any, alerts: list[Alert]) -> list[Alert]:
        step, ctx = frame.step, self.ctx
        last = self._begun[-1][0] if self._begun else step
        rec = self.ring.find(step)
        slot = self.snap.find(step)
        sent = frame.sentinel
        skipped = bool(sent is not None and (sent.skipped or sent.any_rank_bad))
        held = self._held if (self._held is not None
                              and self._held.first <= step <= self._held.last) else None
        source = ("slot" if slot is not None else "held" if held is not None else
                  "current" if skipped and ctx.guard_holds() and last - step < ctx.hold_limit
                  else None)
        lacks, why = [], None
        state_bytes = 0
        if source is None:
            lacks, why = ["model", "optimizer"], self._why_no_state(skipped)
        elif source != "held":
            state_bytes = slot.nbytes if slot is not None else state_nbytes(
                ctx.model, ctx.optimizer, self._names)
            room = self.store.max_bytes - (0 if self.store.retention is Retention.KEEP_LAST
                                           else self.store.nbytes)   # keep_last makes room
            budget = host_budget()
            limit = min(room, budget) if budget is not None else room
            if state_bytes > limit:
                why = (f"its weights and optimizer state take {state_bytes} bytes, more than "
                       f"the capture budget of {limit} bytes (the smaller of "
                       f"{100 * HOST_FRACTION:g} % of host memory and what "
                       f"capture.max_bytes={self.store.max_bytes} leaves)")
                lacks, source, state_bytes = ["model", "optimizer"], None, 0
        if rec is None and slot is None:
            lacks += ["batch", "rng"]
            why = (why + "; " if why else "") + ("the step's batch and RNG states were no longer "
                                                 "held (its frame was read too late)")
        need = state_bytes + batch_bytes(rec.batch if rec is not None else None) + (1 << 16)
        refusal = self.store.make_room(need)
        if refusal is not None:
            self._warn("limit", f"step {step} not captured: {refusal}")
            return alerts
        name = self.store.reserve(f"step{step:08d}-rank{ctx.rank}", need)
        held_span = (held.first, held.last) if held is not None else (
            (step, last) if source == "current" else None)
        p = _Pending(step, name, source, lacks, why, rec, {}, after=last,
                     seq=slot.seq if slot is not None else -1, held=held_span,
                     done=ctx.config.escalate_steps <= 0)
        said = note(p)
        extra = {"capture_lacks": list(lacks)}
        if held_span is not None and source != "slot":
            extra["held_steps"] = held_span[1] - held_span[0] + 1
        alerts = [dataclasses.replace(
            a, capture=self._rel(self.root / name), extra={**a.extra, **extra},
            message=a.message + said if a.root and said else a.message) for a in alerts]
        p.manifest = self._manifest(frame, alerts)
        self._pending.append(p)
        self._captured.add(step)
        return alerts

    def _why_no_state(self, skipped: bool) -> str:
        if self.snap.disabled:
            return "start-of-step snapshots were switched off after a failure"
        if skipped and self.ctx.guard_holds():
            return (f"the guard's hold on the skipped step ended before the host read its frame "
                    f"(more than {self.ctx.hold_limit} steps late)")
        if self.policy is SnapshotPolicy.SAMPLED:
            return ("capture.snapshot='sampled' keeps the start-of-step state on sampled steps "
                    "only, and this step's update was applied")
        if self.policy is SnapshotPolicy.EVERY:
            return "every snapshot slot was still held (raise capture_ring)"
        if skipped:
            return "the step was skipped, but the guard does not hold captures' state"
        if self.ctx.guard_holds():
            return ("the guard did not skip the step (its gradients were finite), so its update "
                    "was applied, and capture.snapshot='auto' copies no weights per step")
        return ("the step's update was applied (the guard is off: guard.on_nonfinite='skip' keeps "
                "a skipped step's state for its bundle), and capture.snapshot='auto' copies no "
                "weights per step ('sampled' or 'every' do, at their cost)")

    def _manifest(self, frame: Any, alerts: list[Alert]) -> dict:
        ctx = self.ctx
        return {
            "kind": KIND, "schema": BUNDLE_SCHEMA, "alert_schema": SCHEMA_VERSION,
            "step": frame.step, "rank": ctx.rank, "world_size": ctx.world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "alerts": [a.to_dict() for a in alerts],
            "incidents": manifest_incidents(alerts),
            "config": config_to_json(ctx.config),
            "modules": list(ctx.modules),
            "model_factory": ctx.model_factory, "step_fn": ctx.step_fn,
            "versions": versions(), "device": device_info(ctx.model),
            # read with every role (an escalation window): replay reads it so again
            "escalated_step": bool(ctx.escalated(frame.step)),
            "stats": {"keys": [list(k) for k in frame.keys], "phases": list(frame.phases),
                      "scales": list(frame.scales), "rows": rows_to_json(frame.rows),
                      "stat_names": stat_names()},
        }

    # -- training thread, at a step boundary ---------------------------------------------------
    def at_boundary(self) -> Optional[int]:
        """Take the queued copies and write the bundles that are complete. Returns the latest
        step whose frame was decided before the copies were taken: the guard may let go of the
        skipped steps through it."""
        with self._lock:
            decided = self._decided
            if not self._pending:   # most boundaries: nothing queued, nothing to write
                if self._held is not None and decided is not None and decided >= self._held.last:
                    self._held = None
                return decided
            todo = [p for p in self._pending if not p.taken and not p.claimed]
        for p in todo:
            self._take(p)
            self._write(p)
        with self._lock:
            ready = [p for p in self._pending if p.taken and p.done]
            self._pending = [p for p in self._pending if not (p.taken and p.done)]
            if self._held is not None and decided is not None and decided >= self._held.last:
                self._held = None
        for p in ready:
            self._write_escalated(p)
        return decided

    def close(self) -> None:
        """Write every queued bundle (its escalation window cut short), free the ring."""
        try:
            self.at_boundary()
            with self._lock:
                rest, self._pending = self._pending, []
            for p in rest:
                if not p.taken:
                    self._take(p)
                    self._write(p)
                self._write_escalated(p)
        finally:
            self._held = None
            self.ring.clear()
            self.snap.release_through(self._seq)
            self.snap.close()

    def _take(self, p: _Pending) -> None:
        """The copies of one bundle's tensors (training thread)."""
        try:
            if p.source == "slot":
                slot = next((s for s in self.snap.slots if s.seq == p.seq and s.step == p.step),
                            None)
                if slot is None:
                    raise RuntimeError("its snapshot slot was reused")
                if slot.ready is not None:   # a side-stream copy into host memory
                    slot.ready.synchronize()
                events: dict = {}
                with torch.no_grad():
                    p.state = StateCopy({n: to_host(t, events) for n, t in slot.model.items()},
                                        {n: to_host(t, events) for n, t in slot.optim.items()},
                                        slot.optim_meta, p.step, p.step)
                for ev in events.values():   # sync-ok: once per bundle, at a step boundary
                    ev.synchronize()
                p.record = StepRecord(p.step, slot.seq, slot.batch, slot.rng, None)
                with self._lock:
                    self.snap.release_through(slot.seq, keep={
                        q.seq for q in self._pending if q is not p and q.source == "slot"
                        and not q.taken})
            elif p.source == "current":
                last = self._begun[-1][0] if self._begun else p.step
                if last - p.step >= self.ctx.hold_limit:
                    raise RuntimeError(f"the guard's hold ended ({last - p.step} steps late)")
                p.state = copy_state(self.ctx.model, self.ctx.optimizer, self._names, p.step,
                                     last)
                p.held = (p.step, last)
                with self._lock:
                    self._held = p.state
                self.copies.append((p.step, p.state.nbytes))
            elif p.source == "held":
                p.state = self._held
            p.manifest["batch"], p.manifest["rng"], p.batch_tensors, p.rng_tensors = \
                batch_and_rng(p.record)
        except Exception as e:
            self._warn("take", f"the state of step {p.step} could not be copied "
                               f"({type(e).__name__}: {e}); its bundle lacks it")
            if p.state is None and "model" not in p.lacks:
                p.lacks += ["model", "optimizer"]
                p.why = f"copying it failed ({type(e).__name__}: {e})"
            if p.batch_tensors is None:
                p.manifest["batch"], p.manifest["rng"] = {"kind": "none"}, {"cuda_devices": 0}
                p.batch_tensors, p.rng_tensors = {}, {}
                p.lacks += [x for x in ("batch", "rng") if x not in p.lacks]
        p.taken = True

    def _write(self, p: _Pending) -> bool:
        """Write the bundle (all but the escalated rows, which come later). True when written."""
        try:
            m = dict(p.manifest)
            st = p.state
            meta = st.meta if st is not None else None
            if p.record is not None:
                meta = with_hyper(meta, p.record.hyper)
            m["optimizer"] = jsonable(meta) if meta is not None else optim_meta(self.ctx,
                                                                                self._names, p)
            m["lacks"] = list(dict.fromkeys(p.lacks))
            if p.lacks:
                m["lacks_why"] = p.why
            if p.held is not None and p.source != "slot":
                m["held"] = {"first": p.held[0], "last": p.held[1],
                             "skipped_steps": p.held[1] - p.held[0] + 1}
            tensors = {"model": st.model if st is not None else {},
                       "optimizer": st.optim if st is not None else {},
                       "batch": p.batch_tensors, "rng": p.rng_tensors}
            if self.store.reserved(p.name) is None:   # keep_last deleted it to make room
                return False
            p.path = write_bundle(self.root, p.name, m, tensors)
            self.store.settle(p.name, p.path)
            self.written.append(p.path)
            log.info("stabilitywatch: captured step %d in %s%s", p.step, p.path,
                     f" (without {', '.join(m['lacks'])})" if m["lacks"] else "")
            return True
        except Exception as e:
            self.store.settle(p.name, None)
            self._warn("error", f"capture of step {p.step} failed ({type(e).__name__}: {e}); "
                                f"training goes on without its bundle")
            return False
        finally:
            p.state = None   # the bundle is on disk (or not): its copies are not needed

    def _write_escalated(self, p: _Pending) -> None:
        """The escalated steps' rows beside the written bundle (writer.write_rows)."""
        if p.path is None or not p.escalated:
            return
        try:
            write_rows(p.path, p.escalated)
        except Exception as e:
            self._warn("rows", f"the escalated rows of step {p.step}'s bundle were not written "
                               f"({type(e).__name__}: {e})")

    def _rel(self, path: Path) -> str:
        try:
            return os.path.relpath(path, self.ctx.run_dir)
        except ValueError:  # another drive (Windows)
            return str(path)

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("stabilitywatch: %s", msg)
        else:
            log.debug("stabilitywatch: %s", msg)


