"""Reading bundles. Verification comes first: SHA256SUMS must cover exactly the files present,
every checksum must match, and the manifest's own file list must agree. Tensors are read with
safetensors (a header and raw bytes: no code runs), everything else with json. Nothing is
unpickled and nothing is imported: a planted pickle is an unexpected file, an error.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .writer import BUNDLE_SCHEMA, KIND, MANIFEST, SUMS, TENSOR_FILES, sha256_file


class CaptureError(ValueError):
    """A missing, truncated, tampered or unsupported bundle (one-line message)."""


@dataclass
class Capture:
    path: Path
    manifest: dict
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def tensors(self, stem: str, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
        """The tensors of model/optimizer/batch/rng.safetensors (read once, on the CPU)."""
        if stem not in self._tensors:
            self._tensors[stem] = _load_safetensors(self.path / f"{stem}.safetensors")
        return {k: v.to(device) for k, v in self._tensors[stem].items()}

    def header(self, stem: str) -> dict[str, dict]:
        """Key -> {dtype, shape} from the safetensors header, without reading the data."""
        return _header(self.path / f"{stem}.safetensors")


def open_capture(path: "str | Path") -> Capture:
    """Verify and open a bundle. Raises CaptureError with a one-line reason."""
    p = Path(path)
    if not p.exists():
        raise CaptureError(f"capture {str(path)!r} does not exist")
    if p.is_file() and p.name in (MANIFEST, SUMS):
        p = p.parent
    if not p.is_dir():
        raise CaptureError(f"capture {str(path)!r} is not a directory (a capture is the "
                           f"directory holding {MANIFEST})")
    sums_path = p / SUMS
    if not (p / MANIFEST).is_file():
        raise CaptureError(f"{p}: no {MANIFEST}: not a capture bundle, or an incomplete one")
    if not sums_path.is_file():
        raise CaptureError(f"{p}: {SUMS} is missing: the bundle is incomplete or was altered")
    sums = _read_sums(sums_path)
    present = {f.name for f in p.iterdir()} - {SUMS}
    unexpected = sorted(present - set(sums))
    if unexpected:
        raise CaptureError(f"{p}: unexpected file(s) {', '.join(unexpected)} not covered by "
                           f"{SUMS}: the bundle was altered; refusing to load it")
    missing = sorted(set(sums) - present)
    if missing:
        raise CaptureError(f"{p}: file(s) {', '.join(missing)} missing: the bundle is incomplete")
    for name, digest in sorted(sums.items()):
        if (p / name).is_dir() or sha256_file(p / name) != digest:
            raise CaptureError(f"{p}: checksum mismatch for {name}: the file was truncated or "
                               f"altered")
    try:
        manifest = json.loads((p / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CaptureError(f"{p}: {MANIFEST} is not valid JSON ({e})") from None
    _check_manifest(p, manifest, sums)
    return Capture(p, manifest)


def _read_sums(path: Path) -> dict[str, str]:
    out = {}
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if (not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
                or not name or "/" in name or name.startswith(".")):
            raise CaptureError(f"{path}: line {i} is not '<sha256>  <file name>'")
        out[name] = digest
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
    for stem in TENSOR_FILES:
        name = f"{stem}.safetensors"
        if name not in files or sums.get(name) != files[name].get("sha256"):
            raise CaptureError(f"{p}: {name} is not listed consistently in {MANIFEST} and {SUMS}")
    st = m["stats"]
    rows, keys = st.get("rows"), st.get("keys")
    if not isinstance(rows, list) or not isinstance(keys, list) or len(rows) != len(keys):
        raise CaptureError(f"{p}: the statistics rows in {MANIFEST} are malformed")


def _header(path: Path) -> dict[str, dict]:
    """The safetensors header (8-byte length, then JSON): no tensor data is read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        body = f.read(n) if 0 < n <= 1 << 27 else b""
    try:
        if len(body) != n:
            raise ValueError("bad length")
        head = json.loads(body)
        return {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in head.items()
                if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CaptureError(f"{path}: not a readable safetensors file (bad header)") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorError, header errors: one line
        raise CaptureError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None


def rng_python(m: dict) -> Optional[tuple]:
    st = m.get("python")
    if not isinstance(st, list) or len(st) != 3:
        return None
    return (st[0], tuple(st[1]), None if st[2] is None else float(st[2]))


def rng_numpy(m: dict) -> Optional[tuple]:
    import numpy as np

    st = m.get("numpy")
    if not isinstance(st, list) or len(st) != 5:
        return None
    cached = float(st[4])  # a number, or "nan"/"inf" written as a string
    return (st[0], np.array(st[1], dtype=np.uint32), int(st[2]), int(st[3]),
            cached if math.isfinite(cached) else 0.0)
