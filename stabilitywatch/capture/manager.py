"""Capture inside a Monitor: snapshot at step start, bundle when a frame's alerts ask for it.

The Monitor calls `begin` from its step start (hot path: the snapshot only) and `on_frame` when a
step's statistics have been read and its alerts decided (off the hot path: writing a bundle syncs
with the device and touches the disk, only on flagged steps). A failure here never reaches
training: one warning, the alert is recorded with `capture: null`.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..alert import SCHEMA_VERSION, Alert
from ..incidents import manifest_incidents
from ..stats.layout import HIST_BINS, HIST_EMIN, N_SCALAR, Stat
from .policy import SnapshotPolicy, matches, triggers
from .snapshot import Slot, Snapshotter
from .treeio import config_to_json, encode_tree, jsonable, rows_to_json
from .writer import BUNDLE_SCHEMA, KIND, Store, write_bundle

log = logging.getLogger("stabilitywatch")


def stat_names() -> list[str]:
    return [Stat(i).name.lower() for i in range(N_SCALAR)] + \
        [f"hist[{HIST_EMIN + b}]" for b in range(HIST_BINS)]


class CaptureManager:
    def __init__(self, monitor: Any):
        cfg = monitor.config
        self.mon = monitor
        self.triggers = triggers(cfg.capture.triggers)
        self.policy = cfg.capture.snapshot
        root = Path(cfg.capture.dir)
        self.root = root if root.is_absolute() else monitor.run_dir / root
        self.store = Store(self.root, cfg.capture.max, cfg.capture.max_bytes, cfg.capture.retention)
        self.snap = Snapshotter(monitor.model, monitor.optimizer, ring=cfg.capture.ring,
                                target=cfg.capture.snapshot_to)
        self.written: list[Path] = []
        self._begun: list[tuple[int, int]] = []   # (step, seq) of recent step starts
        self._seq = 0
        self._warned: set[str] = set()

    # -- hot path ------------------------------------------------------------------------------
    def begin(self, step: int, batch: Any, sampled: bool) -> None:
        seq, self._seq = self._seq, self._seq + 1
        self._begun = self._begun[-63:] + [(step, seq)]
        if self.policy is SnapshotPolicy.OFF or self.store.full:
            return                        # nothing could be written: do not pay for snapshots
        if self.policy is SnapshotPolicy.SAMPLED and not sampled:
            return
        try:
            self.snap.take(step, batch, seq)
        except Exception as e:  # never let a snapshot stop training
            self.snap.disabled = True
            self._warn("snap", f"start-of-step snapshots switched off ({type(e).__name__}: {e})")

    # -- off the hot path ----------------------------------------------------------------------
    def on_frame(self, frame: Any, alerts: list[Alert]) -> list[Alert]:
        """The alerts of one step, with `capture` set when a bundle was written for it."""
        try:
            if any(matches(self.triggers, a.detector, a.severity.value) for a in alerts):
                rel = self._capture(frame, alerts)
                if rel is not None:
                    alerts = [dataclasses.replace(a, capture=rel) for a in alerts]
        except Exception as e:
            self._warn("error", f"capture of step {frame.step} failed ({type(e).__name__}: {e}); "
                                f"training goes on, the alert is recorded without a capture")
        finally:
            seq = next((q for s, q in reversed(self._begun) if s == frame.step), None)
            if seq is not None:
                self.snap.release_through(seq)
        return alerts

    def close(self) -> None:
        self.snap.release_through(self._seq)
        self.snap.close()

    def _capture(self, frame: Any, alerts: list[Alert]) -> Optional[str]:
        slot = self.snap.find(frame.step)
        if slot is None:
            why = ("snapshots are switched off" if self.snap.disabled or
                   self.policy is SnapshotPolicy.OFF else
                   "its start-of-step state was not kept (capture.snapshot='sampled' keeps it on "
                   "sampled steps only; 'every' keeps it on every step)"
                   if self.policy is SnapshotPolicy.SAMPLED else
                   "every snapshot slot was still held (raise capture.ring)")
            if not self.store.full:
                self._warn("noslot", f"step {frame.step} not captured: {why}")
            return None
        if slot.ready is not None:  # a side-stream copy into host memory: wait for it here,
            slot.ready.synchronize()  # off the hot path (an alert is being captured)
        tensors, manifest = self._contents(frame, slot, alerts)
        need = sum(t.numel() * t.element_size() for g in tensors.values() for t in g.values())
        refusal = self.store.make_room(need)
        if refusal is not None:
            self._warn("limit", f"step {frame.step} not captured: {refusal}")
            return None
        name = f"step{frame.step:08d}-rank{self.mon.rank}"
        path = write_bundle(self.root, name, manifest, tensors)
        self.store.add(path)
        self.written.append(path)
        log.info("stabilitywatch: captured step %d in %s", frame.step, path)
        try:
            return os.path.relpath(path, self.mon.run_dir)
        except ValueError:  # another drive (Windows)
            return str(path)

    def _contents(self, frame: Any, slot: Slot, alerts: list[Alert]):
        mon = self.mon
        batch_tensors: dict[str, torch.Tensor] = {}
        batch_tree = encode_tree(slot.batch, batch_tensors)
        batch_tensors = {k: v.detach().cpu().clone() for k, v in batch_tensors.items()}
        rng = slot.rng
        rng_tensors = {"torch": rng["torch"]}
        for i, st in enumerate(rng.get("cuda", [])):
            rng_tensors[f"cuda.{i}"] = st
        np_state = rng["numpy"]
        manifest = {
            "kind": KIND, "schema": BUNDLE_SCHEMA, "alert_schema": SCHEMA_VERSION,
            "step": frame.step, "rank": mon.rank, "world_size": mon.world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "alerts": [a.to_dict() for a in alerts],
            "incidents": manifest_incidents(alerts),
            "config": config_to_json(mon.config),
            "modules": [n for n, _ in mon.modules],
            "model_factory": mon.model_factory, "step_fn": mon.step_fn,
            "versions": _versions(), "device": _device(mon.model),
            "stats": {"keys": [list(k) for k in frame.keys], "phases": list(frame.phases),
                      "scales": list(frame.scales), "rows": rows_to_json(frame.rows),
                      "stat_names": stat_names()},
            "optimizer": jsonable(slot.optim_meta),
            "batch": batch_tree,
            "rng": {"python": jsonable(rng["python"]),
                    "numpy": [np_state[0], np_state[1].tolist(), *jsonable(list(np_state[2:]))],
                    "cuda_devices": len(rng.get("cuda", []))},
        }
        tensors = {"model": slot.model, "optimizer": slot.optim, "batch": batch_tensors,
                   "rng": rng_tensors}
        return tensors, manifest

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("stabilitywatch: %s", msg)
        else:
            log.debug("stabilitywatch: %s", msg)


def _versions() -> dict:
    def ver(pkg: str) -> Optional[str]:
        try:  # metadata only: importing triton here would be slow and is not needed
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    from .. import __version__
    return {"stabilitywatch": __version__, "torch": torch.__version__, "triton": ver("triton"),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available() else None,
            "numpy": ver("numpy"), "safetensors": ver("safetensors"),
            "python": platform.python_version()}


def _device(model: torch.nn.Module) -> dict:
    p = next(iter(model.parameters()), None)
    dev = p.device if p is not None else torch.device("cpu")
    out = {"type": dev.type, "index": dev.index, "host": platform.machine(),
           "cpu": platform.processor() or None, "gpu": None}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out["gpu"] = props.name
        out["capability"] = f"{props.major}.{props.minor}"
    return out
