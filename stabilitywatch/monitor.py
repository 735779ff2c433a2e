"""The Monitor assembles the parts: module selection, taps, the statistics buffer, detectors
and sinks. It holds no statistics logic of its own."""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from .alert import SCHEMA_VERSION, Alert
from .capture.context import CaptureContext
from .capture.manager import CaptureManager
from .capture.treeio import config_to_json
from .config import Config, Role
from .detectors.base import Cooldown
from .detectors import build_detectors
from .distributed import make_coordinator
from .distributed.coordinator import dist_info
from .distributed.runinfo import RunInfo
from .escalation import SentinelControl
from .guard import HOLD_LIMIT
from .inplace import InPlaceRerun
from .hooks.extra import ExtraTaps
from .integrations.accelerate import unwrap_optimizer
from .hooks.observers import attach_observers, detach_observers
from .hooks.selectors import select_modules
from .hooks.sentinel import SentinelTap
from .hooks.update import UpdateTap
from .hooks.taps import FORWARD_ROLES, Taps, assume_constant, compiled_model, planned_rows
from .incidents import Incidents
from .kernels import op as _op  # noqa: F401  (registers torch.ops.stabilitywatch.*)
from .kernels.backend import kernel_backend
from .hooks.tensors import float_tensors
from .observe_args import check_observe
from .processing import Processor
from .records import FrameRecords
from .rundir import fresh_run_dir, write_manifest
from .handling import FrameHandling
from .pacing import Pacer
from .schedule import Schedule
from .sinks.factory import make_sinks
from .sinks.runner import SinkRunner
from .stats.buffer import Phase, StatsBuffer, StatsFrame
from .stats.reference import SUPPORTED_DTYPES, is_supported

log = logging.getLogger("stabilitywatch")


class Monitor(FrameHandling):
    """Watches one model (and optionally its optimizer). Build it with `stabilitywatch.watch`."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 config: Optional[Config] = None, run_dir: "str | os.PathLike | None" = None,
                 model_factory: Optional[str] = None, step_fn: Optional[str] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"stabilitywatch.watch: model must be a torch.nn.Module, "
                            f"got {type(model).__name__}")
        optimizer = unwrap_optimizer(optimizer)  # Accelerate's and Lightning's wrappers
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"stabilitywatch.watch: optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise TypeError(f"stabilitywatch.watch: config must be a stabilitywatch.Config, "
                            f"got {type(config).__name__}")
        for label, path in (("model_factory", model_factory), ("step_fn", step_fn)):
            if path is not None and (not isinstance(path, str) or ":" not in path):
                raise ValueError(f"stabilitywatch.watch: {label} must be an import path "
                                 f"'package.module:function', got {path!r}")
        self.model, self.optimizer, self.config = model, optimizer, config
        self.model_factory, self.step_fn = model_factory, step_fn
        rank, world = dist_info()
        self.rank = config.rank if config.rank is not None else rank
        self.world_size = world
        if run_dir is None:
            run_dir = Path("runs") / time.strftime("stabilitywatch-%Y%m%d-%H%M%S")
        # a directory that holds a previous run is not appended to (rundir.py)
        self.run_dir = fresh_run_dir(run_dir, self.rank, self.world_size)
        self.alerts: list[Alert] = []
        self.frames_seen = 0
        self._closed = False
        self._step: Optional[int] = None
        self._last_step: Optional[int] = None   # the number of the last step begun
        self._depth = 0                          # `with mon.step()` blocks open, nested ones too
        self._on: frozenset[Role] = frozenset()
        self._warned: set[str] = set()
        self._scales: dict[str, float] = {}   # role -> config.scale_for(role)

        self.modules = select_modules(model, config)
        self.schedule = Schedule(config)
        first = next(model.parameters(), None)
        # the cost budget: the run's own step times stretch the cadences (pacing.py)
        self.pacer = self.schedule.pacer = Pacer(config.cost_budget, config.every,
                                                 first.device if first is not None else None,
                                                 self.world_size)
        self.buffer = StatsBuffer(kernel_backend(config.backend.value),
                                  capacity=planned_rows(self.modules))
        self.detectors = build_detectors(config, optimizer, self.modules)
        # torch.distributed: DTensor shards, lockstep cross-rank flushes, replica divergence
        # (distributed/coordinator.py); a pass-through in a single process
        self.dist = make_coordinator(RunInfo(rank=self.rank, world_size=self.world_size,
                                             config=config, has_optimizer=optimizer is not None,
                                             release=self._release_frame))
        self.detectors += self.dist.detectors()
        # per row set, the detectors with something to read there (detectors.base.idle)
        self._busy: dict = {}
        self.cooldown = Cooldown(config.incidents.cooldown)
        # detectors, incidents, capture decisions and records run off the training thread
        # (processing.py); `_handle` is looked up per frame, so a wrapper of it sees every frame;
        # a weak reference: the thread does not keep a monitor that was never closed alive
        self.processor = Processor(_handler(weakref.ref(self)),
                                   threaded=config.processing == "thread",
                                   lag=config.processing_lag, timeout=config.processing_timeout)
        self.incidents = Incidents(config)
        self._frame_records = FrameRecords()
        # shadow replicas and logits taps (hooks/extra.py); validates its globs before any I/O
        self.extras = ExtraTaps(model, config, self.modules, self._record, self._is_on)
        self._write_manifest()
        self.sinks = SinkRunner(make_sinks(self.dist.sink_config(config), self.run_dir, self.rank,
                                           self.world_size), queue_size=config.sinks.queue_size,
                                timeout=config.sinks.timeout,
                                close_timeout=config.sinks.close_timeout)
        self._owner = _op.register_owner(self.buffer)   # for compiled backwards (kernels/op.py)
        self.taps = Taps(self.modules, optimizer, self._record, self._is_on, self._record_traced,
                         self._record_many)
        # every step: non-finite count, absmax and sum of squares of every gradient
        self.sentinel = SentinelTap(self.taps.params, self.buffer.sentinel,
                                    lambda: (config.sentinel and self._step is not None
                                             and not self.extras.running),
                                    self.dist.local, optimizer=optimizer is not None)
        self.taps.sentinel = self.sentinel
        self.sentinel.pacer = self.pacer
        self.taps.keep_forward = compiled_model(model)
        if config.update.stats and optimizer is not None:   # ||dW|| / ||W|| on sampled steps
            self.taps.update = UpdateTap(self.taps.params, self._record_many, self._is_on,
                                         self.dist.local)
        # the step's flag (cross-rank), the guard, escalation (escalation.py)
        self.control = SentinelControl(self)
        self.inplace = InPlaceRerun(self)     # rerun_skipped: a skipped step again, every role
        # start-of-step snapshots and bundles of flagged steps (capture/manager.py)
        self.capture = CaptureManager(self._capture_context()) if config.capture.triggers else None
        self.observers = attach_observers(model, self.observe)
        try:
            self.taps.attach()
            self.extras.attach()
        except Exception:
            detach_observers(self.observers)
            self.taps.detach()
            self.extras.detach()
            self.sinks.close()
            raise

    # -- public API ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int, batch: Any = None) -> Iterator["Monitor"]:
        """One training step. Tensors are read on the steps the schedule samples; the rows of a
        step are read on the host one step later (or at close()).

        Usage slips warn once each and never stop training: a step number that repeats the last
        one or goes backwards is used as given; a block opened inside another step's block is
        part of that outer step (the outer step's number counts, the inner `batch` is not kept,
        and the step ends when the outer block ends)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"Monitor.step: step must be an int, got {type(step).__name__}")
        if self._closed:
            raise RuntimeError("Monitor.step: the monitor is closed")
        if self._depth and self._step is not None:
            self._warn_once("step:nested", f"mon.step({step}) was entered inside the block of "
                            f"step {self._step}: steps do not nest; its tensors count as step "
                            f"{self._step}, which ends with the outer block")
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._check_order(step)
        self._begin(step, batch)
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            self._end()

    def _check_order(self, step: int) -> None:
        last, self._last_step = self._last_step, step
        if last is None or step > last:
            return
        if step == last:
            self._warn_once("step:repeat", f"mon.step({step}) repeats step {last}: each step "
                            f"number should be used once; both are recorded as step {step}")
        else:
            self._warn_once("step:backwards", f"mon.step({step}) comes after step {last}: step "
                            f"numbers go backwards; recorded as given (detectors see the steps "
                            f"in call order)")

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record the loss of the current step (no host sync)."""
        if not isinstance(loss, torch.Tensor):
            if loss is not None:  # sync-ok: not a tensor; a float (loss.item()) has no row
                self._warn_once("observe_loss", f"observe_loss needs the loss tensor, got "
                                f"{type(loss).__name__}; not recorded")
            return
        if self._step is None:
            return
        if Role.LOSS in self._on:
            self._safe_record(loss.detach(), "", "loss", Phase.LOSS, False)

    def observe(self, tensor: torch.Tensor, role: str, *, module: str = "",
                scale: "float | torch.Tensor | None" = None) -> None:
        """Record a tensor the training code computes itself (an FP8 cast, a scale, an amax
        history) as (module, role) of the current step, on sampled steps; `scale` overrides
        Config.scales for the format counts (a 0-dim device tensor is fine). No host sync.

        The arguments are checked on every call, inside a step or not (observe_args.py): a bad
        one raises TypeError/ValueError naming it, and nothing is recorded."""
        check_observe(tensor, role, module, scale)
        if self._step is None or not (self._on - {Role.LOSS}):
            return
        phase = Phase.BACKWARD if "grad" in role else Phase.FORWARD
        try:
            self._record(tensor.detach(), module, role, phase, False, scale=scale)
        except Exception as e:
            self._warn_once(f"observe:{module}:{role}", f"observing {module or '<model>'} {role} "
                            f"failed ({type(e).__name__}: {e}); skipped")

    def close(self) -> None:
        """Flush every pending step, run the detectors on it, detach every hook, close sinks.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._step is not None:
                self._end()
            self._process(block=True)
            self._boundary()
        except Exception as e:
            log.warning("stabilitywatch: flushing the last steps failed (%s: %s)",
                        type(e).__name__, e)
        finally:
            try:   # every frame already queued reaches the sinks before they close
                self.processor.drain()
            except Exception as e:
                log.warning("stabilitywatch: processing the last frames failed (%s: %s)",
                            type(e).__name__, e)
            detach_observers(self.observers)
            self.taps.detach()
            self.extras.detach()
            if self.capture is not None:
                self.capture.close()
            self.sinks.close()
            # what each sink did not write; where the cost budget changed the cadence
            self._write_manifest(sinks=self.sinks.report(), cadence=self.pacer.changes)
            self.dist.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- for trainer callbacks (integrations/), whose start and end of a step are two events ----
    def begin_step(self, step: int, batch: Any = None) -> None:
        """Start step `step` without a `with` block; `end_step()` ends it. A step still open is
        ended first."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"Monitor.begin_step: step must be an int, got {type(step).__name__}")
        if self._closed:
            raise RuntimeError("Monitor.begin_step: the monitor is closed")
        self._check_order(step)
        self._begin(step, batch)

    def end_step(self) -> None:
        """End the step begin_step opened (nothing when none is open)."""
        if self._step is not None:
            self._end()

    def observe_batch(self, batch: Any) -> None:
        """Batch tensors of the open step given after its start (a trainer's micro-batches):
        read as module "" roles `input...`, named as for a batch given to the step's start."""
        if self._step is None or Role.OUTPUT not in self._on or batch is None:
            return
        found = list(float_tensors(batch))
        for suffix, t in found:
            role = "input" if len(found) == 1 else "input" + suffix
            self._safe_record(t.detach(), "", role, Phase.BATCH, False)

    def observe_grads(self) -> None:
        """Read the parameter gradients now, as the optimizer pre-step tap does: for trainers
        whose optimizer.step(closure) runs the backward inside the step, after that tap."""
        if self._step is not None and self.optimizer is not None:
            self.taps.read_grads(self.optimizer)

    @property
    def sampling(self) -> bool:
        """True inside a step whose tensors are read (not only the loss): integrations check
        it before computing what they would observe."""
        return bool(self._on - {Role.LOSS}) and not self.extras.running

    # -- step plumbing ------------------------------------------------------------------------
    def _begin(self, step: int, batch: Any) -> None:
        if self._step is not None:  # a step left open (an exception outside the with block)
            self._end()
        self.pacer.begin(step)   # first: the mark ends the step before, waits included
        # what the frames processed by now asked of this thread (escalation: before the roles)
        self.processor.at_begin()
        self._boundary()
        self._step = step
        self._on = self.schedule.roles_at(step)
        self.pacer.sampled(bool(self._on - {Role.LOSS}))
        self.taps.begin_step(self._on)
        self.taps.set_forward(bool(self._on & FORWARD_ROLES))
        self.buffer.begin_step(step)
        if self.taps.compiled and self.taps.traced_on is not None:
            self.buffer.mark_untracked()   # compiled graphs write rows the host does not see
        self.sentinel.begin()
        self.inplace.begin(batch)
        # the batch is the model's input (module ""): a NaN already in the data is named so
        self.observe_batch(batch)
        self.taps.weights()
        self.extras.begin_step(self._on)
        if self.capture is not None:
            sampled = bool(self._on - {Role.LOSS})
            self._snapshot_room(sampled)
            self.capture.begin(step, batch, sampled=sampled)

    def _end(self) -> None:
        self.sentinel.at_end()
        step, queued = self._step, self.buffer.pending
        try:
            self.buffer.end_step()
        except Exception as e:
            self._warn_once("end_step", f"reading the step's rows failed ({type(e).__name__}: {e})")
        self._step = None
        self._on = frozenset()
        self.taps.begin_step(self._on)
        self.extras.end_step()
        if self.inplace.on and self.buffer.pending > queued:
            self.inplace.wait(self.buffer.last_pending())
        self._process(block=False)
        self._boundary()
        if step is not None:
            self.inplace.after_frames(step)

    def _boundary(self) -> None:
        """Between steps, on the training thread: captures take their copies (capture/
        manager.py), then the guard lets go of the skipped steps whose frames were handled."""
        through = self.control.read_through
        if self.capture is not None:
            try:   # frames read but not yet decided on by capture keep their hold
                decided = self.capture.at_boundary()
                if decided is not None and through is not None:
                    through = min(through, decided)
            except Exception as e:
                self._warn_once("capture", f"capture failed ({type(e).__name__}: {e})")
        self.control.release(through)

    def _capture_context(self) -> CaptureContext:
        control = self.control
        return CaptureContext(
            model=self.model, optimizer=self.optimizer, config=self.config,
            run_dir=self.run_dir, rank=self.rank, world_size=self.world_size,
            modules=tuple(n for n, _ in self.modules), model_factory=self.model_factory,
            step_fn=self.step_fn, escalated=self.schedule.escalated,
            guard_holds=lambda: control.guard is not None and control.guard.hold,
            hold_limit=HOLD_LIMIT)

    def _is_on(self, role: Role) -> bool:
        # while a shadow replica runs, its tensors are not the live ones: the taps stay quiet
        return role in self._on and not self.extras.running

    def _record(self, t: torch.Tensor, module: str, role: str, phase: int, overwrite: bool,
                scale: "float | torch.Tensor | None" = None) -> None:
        if self._step is None or (t.dtype not in SUPPORTED_DTYPES
                                  and not self._readable(t, module, role)):
            return
        if type(t) is not torch.Tensor:   # a subclass may be a DTensor: its local shard
            t = self.dist.local(t, module, role)
        if scale is None:
            scale = self._scales.get(role)
            if scale is None:
                scale = self._scale_for(role)
        self.buffer.add(t, module, role, phase, scale, overwrite)

    def _record_many(self, items: list, phase: int, overwrite: bool) -> None:
        """_record for many (tensor, module, role) at once (the taps over every parameter): the
        buffer reads the small ones in one launch. A tensor it cannot read is skipped with a
        warning; a failing batch raises (the tap that called it is switched off)."""
        if self._step is None:
            return
        scales, plain, local = self._scales, torch.Tensor, self.dist.local
        ready = [(t if type(t) is plain else local(t, module, role), module, role,
                  scales.get(role) or self._scale_for(role))
                 for t, module, role in items
                 if t.dtype in SUPPORTED_DTYPES or self._readable(t, module, role)]
        self.buffer.add_many(ready, phase, overwrite)

    def _readable(self, t: torch.Tensor, module: str, role: str) -> bool:
        if is_supported(t):
            return True
        self._unsupported(module, role, t.dtype)
        return False

    def _unsupported(self, module: str, role: str, dtype: torch.dtype) -> None:
        self._warn_once(f"dtype:{module}:{role}",
                        f"{module or '<model>'} {role}: dtype {dtype} is not supported; skipped")

    def _scale_for(self, role: str) -> float:
        # config.scale_for is a glob lookup; a role's answer never changes (frozen config)
        scale = self._scales.get(role)
        if scale is None:
            scale = self._scales[role] = self.config.scale_for(role)
        return scale

    def _record_traced(self, t: torch.Tensor, module: str, role: str, phase: int) -> None:
        """The record path traced by torch.compile: a custom-op call on the step's rows, the
        slot a constant of the graph (made while tracing): no graph break, no guard on the
        slot table."""
        target = self._traced_slot(module, role, t.dtype, t.device, phase)
        if target is None:
            return
        slot, scale = target
        if phase == Phase.BACKWARD:   # a compiled backward: the rows are looked up as it runs
            torch.ops.stabilitywatch.accumulate_slot(t, self._owner, slot, scale,
                                                     self.config.backend.value)
            return
        torch.ops.stabilitywatch.accumulate_row(self.buffer.rows_of(t.device), slot, t, scale,
                                                self.config.backend.value)

    @assume_constant   # a method dynamo calls on the host while it traces: a graph constant
    def _traced_slot(self, module: str, role: str, dtype: torch.dtype, device: torch.device,
                     phase: int):
        # runs on the host at trace time (its answer is a constant of the graph); from now on
        # the steps whose graphs read tensors read every row (_begin), this one too. A dtype
        # the statistics do not read warns here once, and the graph leaves that tensor out.
        self.taps.compiled = True
        self.buffer.mark_untracked()
        if dtype not in SUPPORTED_DTYPES:
            self._unsupported(module, role, dtype)
            return None
        got = self.buffer.traced_slot(module, role, device, self._scale_for(role), phase)
        if got is None:
            self._warn_once(f"traced:{module}:{role}", f"{module or '<model>'} {role}: not read "
                            f"in this compiled graph (its rows are full or on another device)")
        return got

    def _safe_record(self, t, module, role, phase, overwrite) -> None:
        try:
            self._record(t, module, role, phase, overwrite)
        except Exception as e:
            self._warn_once(f"rec:{module}:{role}", f"reading {module or '<model>'} {role} failed "
                            f"({type(e).__name__}: {e}); skipped")

    def _process(self, block: bool) -> None:
        # once per step end (block=False) and at close: the coordinator decides, identically on
        # every rank, when the frames go through the cross-rank collective; what the frames need
        # from this thread is settled here, the rest is queued for the processing thread
        frames = self.dist.frames(self.buffer, final=block)
        self.control.on_polled()
        for frame in frames:
            self.frames_seen += 1
            if frame.sentinel is None:   # a frame merged across ranks: this rank's sentinel
                frame.sentinel = self.buffer.sentinel_of(frame.step)
            frame.rerun = self.inplace.is_rerun_frame(frame)
        # the guard holds the weights until the capture of a skipped step has its copy, which
        # only this thread can take: such a step (a rare one) is processed here, so the bundle
        # is written before its alerts go out and the guard lets go at this boundary, as with
        # inline processing, instead of skipping `lag` more steps
        self.processor.submit(frames, inline=self.capture is not None
                              and any(_guard_skipped(f) for f in frames))

    def _snapshot_room(self, sampled: bool) -> None:
        """A snapshot needs a free slot of the capture ring; the slots are freed as the frames
        of their steps are processed: when every one is held by a frame still queued, wait
        for the processing (bounded by processing_timeout per stage)."""
        if self.capture.ring_full(sampled) and self.processor.backlog:
            self.processor.wait_all()

    def _release_frame(self, frame: StatsFrame) -> None:
        """A frame another rank processes (rank0 mode): its capture snapshot is freed here."""
        if self.capture is not None:
            self.capture.on_frame(frame, [])

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("stabilitywatch: %s", msg)

    def _write_manifest(self, **more: Any) -> None:
        write_manifest(self.run_dir, self.rank, {
            "schema": SCHEMA_VERSION, "rank": self.rank, "world_size": self.world_size,
            "config": config_to_json(self.config), "model_factory": self.model_factory,
            "step_fn": self.step_fn, "modules": [n for n, _ in self.modules],
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            **more})

def _guard_skipped(frame: StatsFrame) -> bool:
    sent = frame.sentinel
    return sent is not None and bool(sent.skipped or sent.any_rank_bad)


def _handler(ref: "weakref.ref[Monitor]"):
    def handle(frame: StatsFrame) -> None:
        mon = ref()
        if mon is not None:
            mon._handle(frame)
    return handle


def watch(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
          config: Optional[Config] = None, run_dir: "str | os.PathLike | None" = None,
          model_factory: Optional[str] = None, step_fn: Optional[str] = None) -> Monitor:
    """Start watching `model` (and `optimizer`). Returns a Monitor; see the README."""
    return Monitor(model, optimizer, config=config, run_dir=run_dir,
                   model_factory=model_factory, step_fn=step_fn)
