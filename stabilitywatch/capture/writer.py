"""Writing bundles: atomically (a temporary directory renamed into place), with a sha256 of every
file, within count and byte limits.

A bundle is a directory:
    manifest.json          step, rank, alerts, config, versions, stats rows, file checksums...
    model.safetensors      parameters and buffers at the start of the step
    optimizer.safetensors  per-parameter optimizer state at the start of the step
    batch.safetensors      the batch's tensors (its structure is in the manifest)
    rng.safetensors        torch CPU/CUDA generator states (Python/NumPy states are in the manifest)
    SHA256SUMS             `sha256sum -c SHA256SUMS` format, covering every file above
    escalated.json         (later) the rows of the escalated steps after it, once they are read,
    escalated.sha256       with its checksum; the files above never change once written
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .policy import Retention

MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
KIND = "stabilitywatch.capture"
BUNDLE_SCHEMA = 1
TENSOR_FILES = ("model", "optimizer", "batch", "rng")
ESCALATED = "escalated.json"
ESCALATED_SUM = "escalated.sha256"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own(t: torch.Tensor) -> torch.Tensor:
    # a host copy that owns its storage: safetensors refuses tensors that share one (the
    # snapshot ring's tensors are views of one flat buffer)
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def write_bundle(root: Path, name: str, manifest: dict,
                 tensors: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write `tensors` (file stem -> {key: tensor}) and the manifest under root/name, atomically.
    Returns the final directory. Raises OSError (or whatever safetensors raises) on failure and
    leaves nothing behind but, at worst, a hidden temporary directory."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        for stem, group in tensors.items():
            fname = f"{stem}.safetensors"
            save_file({k: _own(v) for k, v in group.items()},
                      str(tmp / fname), metadata={"format": "pt"})
            _fsync(tmp / fname)
            files[fname] = {"sha256": sha256_file(tmp / fname), "bytes": (tmp / fname).stat().st_size}
        manifest = {**manifest, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False))
        _fsync(tmp / MANIFEST)
        sums = {**{k: v["sha256"] for k, v in files.items()}, MANIFEST: sha256_file(tmp / MANIFEST)}
        (tmp / SUMS).write_text("".join(f"{h}  {f}\n" for f, h in sorted(sums.items())))
        _fsync(tmp / SUMS)
        final = _free_name(root, name)
        os.rename(tmp, final)          # atomic on one file system: a bundle is whole or absent
        try:
            _fsync(root)
        except OSError:
            pass                       # some file systems cannot fsync a directory
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_rows(bundle: Path, frames: list[dict]) -> None:
    """The escalated steps' rows beside a written bundle: each file written whole under a
    temporary name and renamed into place (the checksum last: a bundle without it has none)."""
    if not (bundle / MANIFEST).is_file():   # deleted since (keep_last made room)
        return
    body = json.dumps({"kind": "stabilitywatch.escalated", "frames": frames}, allow_nan=False)
    for name, text in ((ESCALATED, body), (ESCALATED_SUM, None)):
        tmp = bundle.parent / f".tmp-{bundle.name}-{name}"   # outside: a bundle holds no extras
        if text is None:
            text = f"{sha256_file(bundle / ESCALATED)}  {ESCALATED}\n"
        try:
            tmp.write_text(text)
            _fsync(tmp)
            os.replace(tmp, bundle / name)
        finally:
            tmp.unlink(missing_ok=True)


def _free_name(root: Path, name: str) -> Path:
    final, i = root / name, 1
    while final.exists():              # a resumed run capturing the same step again
        final, i = root / f"{name}.{i}", i + 1
    return final


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@dataclass
class _Entry:
    path: Path
    nbytes: int
    mtime: float
    reserved: bool = False   # named on alerts, not written yet


class Store:
    """The bundles in one directory and the limits on them. Bundles already there (a resumed
    run) count against the limits; temporary directories do not."""

    def __init__(self, root: Path, max_count: int, max_bytes: int, retention: Retention):
        self.root, self.max_count, self.max_bytes = root, max_count, max_bytes
        self.retention = retention
        self.entries: list[_Entry] = []
        try:
            for p in (root.iterdir() if root.is_dir() else ()):
                if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file():
                    self.entries.append(_Entry(p, bundle_bytes(p), p.stat().st_mtime))
        except OSError:  # unreadable: writing will fail later, with its one warning
            pass
        self.entries.sort(key=lambda e: (e.mtime, e.path.name))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def full(self) -> bool:
        """No further bundle can be written (keep_first at a limit)."""
        return (self.retention is Retention.KEEP_FIRST
                and (len(self.entries) >= self.max_count or self.nbytes >= self.max_bytes))

    def make_room(self, need: int) -> Optional[str]:
        """None when a bundle of about `need` bytes may be written now (deleting the oldest
        bundles under keep_last), else the reason it may not."""
        if need > self.max_bytes:
            return f"it would take ~{need} bytes, more than capture.max_bytes={self.max_bytes}"
        if self.retention is Retention.KEEP_FIRST:
            if len(self.entries) >= self.max_count:
                return f"capture.max={self.max_count} bundles already written (keep_first)"
            if self.nbytes + need > self.max_bytes:
                return f"capture.max_bytes={self.max_bytes} would be exceeded (keep_first)"
            return None
        while self.entries and (len(self.entries) >= self.max_count
                                or self.nbytes + need > self.max_bytes):
            old = self.entries.pop(0)
            shutil.rmtree(old.path, ignore_errors=True)
        return None

    def add(self, path: Path) -> None:
        self.entries.append(_Entry(path, bundle_bytes(path), path.stat().st_mtime))

    def reserve(self, name: str, nbytes: int) -> str:
        """A free bundle name, counted against the limits with about `nbytes` until the bundle
        is written (`settle`): alerts name a bundle before it is on disk."""
        taken = {e.path.name for e in self.entries}
        final, i = name, 1
        while final in taken or (self.root / final).exists():
            final, i = f"{name}.{i}", i + 1
        self.entries.append(_Entry(self.root / final, nbytes, time.time(), reserved=True))
        return final

    def reserved(self, name: str) -> Optional[_Entry]:
        return next((e for e in self.entries if e.reserved and e.path.name == name), None)

    def settle(self, name: str, path: Optional[Path]) -> None:
        """The reserved bundle `name` was written at `path`, or not at all (None)."""
        e = self.reserved(name)
        if e is None:
            return
        if path is None:
            self.entries.remove(e)
        else:
            e.path, e.nbytes, e.reserved = path, bundle_bytes(path), False
