"""Reading bundles. A bundle is untrusted input: it may come from another machine or person.

Every file is opened relative to the bundle's directory with O_NOFOLLOW and O_NONBLOCK, and
checked with fstat before a byte is read: a regular file (never a symlink, FIFO or device),
its size what the manifest lists. Reads are bounded by that size, and what is hashed, parsed or
loaded is the bytes read from that one descriptor (no second open by name). Verification comes
first: SHA256SUMS must cover exactly the files present, every checksum must match, and the
manifest's own file list must agree. Tensors are read with safetensors from those bytes (a
header and raw data: no code runs), everything else with json. Nothing is unpickled and nothing
is imported: a planted pickle is an unexpected file, an error.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from .writer import BUNDLE_SCHEMA, ESCALATED, ESCALATED_SUM, KIND, MANIFEST, SUMS, TENSOR_FILES

# Bounds for the two files whose size no other file states. SHA256SUMS holds a handful of
# lines; the manifest holds the step's statistics rows (about 3 kB per row).
MAX_SUMS_BYTES = 1 << 16
MAX_MANIFEST_BYTES = 1 << 30
_CHUNK = 1 << 20
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
    | getattr(os, "O_CLOEXEC", 0)


class CaptureError(ValueError):
    """A missing, truncated, tampered or unsupported bundle (one-line message)."""


@dataclass
class Capture:
    path: Path
    manifest: dict
    sums: dict = field(default_factory=dict, repr=False)
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def tensors(self, stem: str, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
        """The tensors of model/optimizer/batch/rng.safetensors (read once, on the CPU)."""
        if stem not in self._tensors:
            name = f"{stem}.safetensors"
            with _bundle_dir(self.path) as dfd, _checked(dfd, self.path, name,
                                                         self._size(name)) as (fd, n):
                data = _read(fd, n, self.path, name)
            if hashlib.sha256(data).hexdigest() != self.sums.get(name):
                raise CaptureError(f"{self.path}: checksum mismatch for {name}: the file "
                                   f"changed after the bundle was verified")
            self._tensors[stem] = _load_safetensors(data, self.path, name)
        return {k: v.to(device) for k, v in self._tensors[stem].items()}

    def header(self, stem: str) -> dict[str, dict]:
        """Key -> {dtype, shape} from the safetensors header, without reading the data."""
        name = f"{stem}.safetensors"
        with _bundle_dir(self.path) as dfd, _checked(dfd, self.path, name,
                                                     self._size(name)) as (fd, n):
            return _header(fd, n, self.path / name)

    def _size(self, name: str) -> int:
        return self.manifest["files"][name]["bytes"]

    def escalated(self) -> list[dict]:
        """The rows of the escalated steps after the captured one (escalated.json, checked
        against escalated.sha256): [{step, keys, phases, scales, rows}]; [] when the bundle has
        none. Written after the bundle: a file without its checksum is not read."""
        with _bundle_dir(self.path) as dfd:
            present = _entries(dfd, self.path)
            if present.get(ESCALATED) != "file" or present.get(ESCALATED_SUM) != "file":
                return []
            with _checked(dfd, self.path, ESCALATED_SUM, limit=1024) as (fd, n):
                line = _read(fd, n, self.path, ESCALATED_SUM).decode("ascii", "replace")
            with _checked(dfd, self.path, ESCALATED, limit=MAX_MANIFEST_BYTES) as (fd, n):
                raw = _read(fd, n, self.path, ESCALATED)
        if line.split("  ")[0].strip() != hashlib.sha256(raw).hexdigest():
            raise CaptureError(f"{self.path}: checksum mismatch for {ESCALATED}: the file was "
                               f"truncated or altered")
        try:
            body = json.loads(raw)
            frames = body["frames"]
            if not (isinstance(frames, list) and all(
                    isinstance(f, dict) and isinstance(f.get("step"), int)
                    and isinstance(f.get("rows"), list) for f in frames)):
                raise ValueError("frames")
        except (ValueError, TypeError, KeyError, RecursionError):
            raise CaptureError(f"{self.path}: {ESCALATED} is malformed") from None
        return frames


def open_capture(path: "str | Path",
                 progress: Optional[Callable[[int, int], None]] = None) -> Capture:
    """Verify and open a bundle. Raises CaptureError with a one-line reason. `progress(done,
    total)` is called with the bytes hashed so far."""
    p = Path(path)
    if not p.exists():
        raise CaptureError(f"capture {str(path)!r} does not exist")
    if p.name in (MANIFEST, SUMS) and not p.is_dir():
        p = p.parent
    if not p.is_dir():
        raise CaptureError(f"capture {str(path)!r} is not a directory (a capture is the "
                           f"directory holding {MANIFEST})")
    with _bundle_dir(p) as dfd:
        entries = _entries(dfd, p)
        if MANIFEST not in entries:
            raise CaptureError(f"{p}: no {MANIFEST}: not a capture bundle, or an incomplete one")
        if SUMS not in entries:
            raise CaptureError(f"{p}: {SUMS} is missing: the bundle is incomplete or was altered")
        for name, kind in sorted(entries.items()):
            if kind != "file":
                raise CaptureError(f"{p}: {_shown(name)} is {kind}: a bundle holds regular "
                                   f"files only; refusing to read it")
        with _checked(dfd, p, SUMS, limit=MAX_SUMS_BYTES) as (fd, n):
            sums = _parse_sums(_read(fd, n, p, SUMS), p)
        # the escalated rows come later, with their own checksum (Capture.escalated)
        present = set(entries) - {SUMS, ESCALATED, ESCALATED_SUM}
        unexpected = sorted(present - set(sums))
        if unexpected:
            raise CaptureError(f"{p}: unexpected file(s) {', '.join(map(_shown, unexpected))} "
                               f"not covered by {SUMS}: the bundle was altered; refusing to "
                               f"load it")
        missing = sorted(set(sums) - present)
        if missing:
            raise CaptureError(f"{p}: file(s) {', '.join(missing)} missing: the bundle is "
                               f"incomplete")
        with _checked(dfd, p, MANIFEST, limit=MAX_MANIFEST_BYTES) as (fd, n):
            raw = _read(fd, n, p, MANIFEST)
        if hashlib.sha256(raw).hexdigest() != sums[MANIFEST]:
            raise CaptureError(f"{p}: checksum mismatch for {MANIFEST}: the file was truncated "
                               f"or altered")
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise CaptureError(f"{p}: {MANIFEST} is not valid JSON ({why})") from None
        _check_manifest(p, manifest, sums)
        files = manifest["files"]
        total, done = sum(f["bytes"] for f in files.values()), 0
        for name in sorted(files):
            with _checked(dfd, p, name, files[name]["bytes"]) as (fd, n):
                h = hashlib.sha256()
                for chunk in _chunks(fd, n, p, name):
                    h.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
            if h.hexdigest() != sums[name]:
                raise CaptureError(f"{p}: checksum mismatch for {name}: the file was truncated "
                                   f"or altered")
    return Capture(p, manifest, sums)


# -- checked file access ----------------------------------------------------------------------
@contextmanager
def _bundle_dir(p: Path) -> Iterator[int]:
    try:
        dfd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CaptureError(f"{p}: cannot open the bundle directory ({e.strerror})") from None
    try:
        yield dfd
    finally:
        os.close(dfd)


def _entries(dfd: int, p: Path) -> dict[str, str]:
    """Name -> "file", or what else it is (never followed)."""
    out = {}
    try:
        with os.scandir(dfd) as it:
            for e in it:
                out[e.name] = ("a symbolic link" if e.is_symlink() else "a directory"
                               if e.is_dir(follow_symlinks=False) else "file"
                               if e.is_file(follow_symlinks=False)
                               else "not a regular file (a FIFO, socket or device)")
    except OSError as e:
        raise CaptureError(f"{p}: cannot list the bundle directory ({e.strerror})") from None
    return out


@contextmanager
def _checked(dfd: int, p: Path, name: str, size: Optional[int] = None,
             limit: Optional[int] = None) -> Iterator[tuple[int, int]]:
    """(fd, size) of bundle file `name`: opened inside the bundle directory without following
    a link and without blocking, a regular file, of the size given (or at most `limit`)."""
    if not _plain_name(name):
        raise CaptureError(f"{p}: {_shown(name)} is not a plain file name inside the bundle")
    try:
        fd = os.open(name, _FLAGS, dir_fd=dfd)
    except OSError as e:
        why = ("is a symbolic link: a bundle holds regular files only; refusing to follow it"
               if e.errno in (errno.ELOOP, errno.EMLINK) else "is missing" if
               e.errno == errno.ENOENT else f"cannot be opened ({e.strerror})")
        raise CaptureError(f"{p}: {name} {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CaptureError(f"{p}: {name} is not a regular file (a FIFO, socket, device or "
                               f"directory); refusing to read it")
        if size is not None and st.st_size != size:
            raise CaptureError(f"{p}: {name} is {st.st_size} bytes, {MANIFEST} lists {size}: "
                               f"the file was truncated or altered")
        if limit is not None and st.st_size > limit:
            raise CaptureError(f"{p}: {name} is {st.st_size} bytes, more than the {limit} a "
                               f"bundle's {name} may hold")
        yield fd, st.st_size
    finally:
        os.close(fd)


def _chunks(fd: int, n: int, p: Path, name: str) -> Iterator[bytes]:
    """Exactly n bytes from fd, never more (a file that grows is read to n)."""
    left = n
    while left:
        try:
            chunk = os.read(fd, min(left, _CHUNK))
        except OSError as e:
            raise CaptureError(f"{p}: cannot read {name} ({e.strerror})") from None
        if not chunk:
            raise CaptureError(f"{p}: {name} ended after {n - left} of {n} bytes: the file was "
                               f"truncated")
        left -= len(chunk)
        yield chunk


def _read(fd: int, n: int, p: Path, name: str) -> bytes:
    return b"".join(_chunks(fd, n, p, name))


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and name.isprintable() and name not in (".", "..")
            and not name.startswith(".") and "/" not in name and "\\" not in name
            and "\x00" not in name)


def _shown(name: str) -> str:
    return name if _plain_name(name) else repr(name)


# -- the two text files -----------------------------------------------------------------------
def _parse_sums(raw: bytes, p: Path) -> dict[str, str]:
    out = {}
    for i, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if (not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
                or not _plain_name(name)):
            raise CaptureError(f"{p / SUMS}: line {i} is not '<sha256>  <file name>' (a plain "
                               f"name inside the bundle)")
        out[name] = digest
    if MANIFEST not in out:
        raise CaptureError(f"{p / SUMS}: {MANIFEST} is not listed: the bundle was altered")
    return out


def _check_manifest(p: Path, m: Any, sums: dict) -> None:
    if not isinstance(m, dict) or m.get("kind") != KIND:
        raise CaptureError(f"{p}: {MANIFEST} is not a stabilitywatch capture manifest")
    schema = m.get("schema")
    if not isinstance(schema, int) or schema > BUNDLE_SCHEMA:
        raise CaptureError(f"{p}: capture schema {schema!r} is newer than this stabilitywatch "
                           f"reads ({BUNDLE_SCHEMA}); upgrade stabilitywatch")
    for key, kind in (("step", int), ("rank", int), ("alerts", list), ("config", dict),
                      ("stats", dict), ("files", dict), ("batch", dict), ("rng", dict)):
        if not isinstance(m.get(key), kind):
            raise CaptureError(f"{p}: {MANIFEST} field {key!r} is missing or malformed")
    files = m["files"]
    for name, meta in files.items():
        if not _plain_name(name):
            raise CaptureError(f"{p}: {MANIFEST} lists {_shown(name)}: not a plain file name "
                               f"inside the bundle")
        size = meta.get("bytes") if isinstance(meta, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CaptureError(f"{p}: {MANIFEST} gives no size in bytes for {name}")
    if set(files) != set(sums) - {MANIFEST}:
        raise CaptureError(f"{p}: the files listed in {MANIFEST} and in {SUMS} differ")
    for stem in TENSOR_FILES:
        name = f"{stem}.safetensors"
        if name not in files or sums.get(name) != files[name].get("sha256"):
            raise CaptureError(f"{p}: {name} is not listed consistently in {MANIFEST} and {SUMS}")
    st = m["stats"]
    rows, keys = st.get("rows"), st.get("keys")
    if not isinstance(rows, list) or not isinstance(keys, list) or len(rows) != len(keys):
        raise CaptureError(f"{p}: the statistics rows in {MANIFEST} are malformed")


# -- safetensors ------------------------------------------------------------------------------
def _header(fd: int, n: int, path: Path) -> dict[str, dict]:
    """The safetensors header (8-byte length, then JSON): no tensor data is read."""
    raw = os.read(fd, 8) if n >= 8 else b""
    size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    body = b""
    if 0 < size <= min(n - 8, 1 << 27):
        body = _read(fd, size, path.parent, path.name)
    try:
        if len(body) != size:
            raise ValueError("bad length")
        head = json.loads(body)
        return {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in head.items()
                if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CaptureError(f"{path}: not a readable safetensors file (bad header)") from None


def _load_safetensors(data: bytes, p: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # SafetensorError, header errors: one line
        raise CaptureError(f"{p / name}: not a readable safetensors file ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None


# -- RNG states from the manifest -------------------------------------------------------------
def _ints(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32 for x in v)


def rng_python(m: dict) -> Optional[tuple]:
    st = m.get("python")
    if st is None:
        return None
    if not (isinstance(st, list) and len(st) == 3 and isinstance(st[0], int)
            and _ints(st[1], 625) and (st[2] is None or isinstance(st[2], (int, float)))):
        raise CaptureError(f"{MANIFEST}: the Python RNG state is malformed")
    return (st[0], tuple(st[1]), None if st[2] is None else float(st[2]))


def rng_numpy(m: dict) -> Optional[tuple]:
    import numpy as np

    st = m.get("numpy")
    if st is None:
        return None
    if not (isinstance(st, list) and len(st) == 5 and st[0] == "MT19937" and _ints(st[1], 624)
            and isinstance(st[2], int) and isinstance(st[3], int)
            and (isinstance(st[4], (int, float)) or st[4] in ("nan", "inf", "-inf"))):
        raise CaptureError(f"{MANIFEST}: the NumPy RNG state is malformed")
    cached = float(st[4])  # a number, or "nan"/"inf" written as a string
    return (st[0], np.array(st[1], dtype=np.uint32), int(st[2]), int(st[3]),
            cached if math.isfinite(cached) else 0.0)
