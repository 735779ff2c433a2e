"""Finding the replay verdicts that belong to a run's capture bundles, and its bundles' paths.

A replay report is the JSON that `stabilitywatch replay CAPTURE --json FILE` writes: an object
holding `reproduces`. The report looks for `*.json` files (up to MAX_BYTES each, not recursing)
in three places: the run directory, the directory that holds the bundles (`captures/`), and the
bundle directory itself (`manifest.json` excluded). A report belongs to a bundle when its
`capture` field names that bundle (the bundle directory's name, so a report written on another
machine or from another working directory still matches) or, when it has no `capture` field, when
its file name starts with the bundle's name. Where several belong to one bundle, the newest file
(modification time) is shown and the others are counted. The suggested place is beside the
bundle: `stabilitywatch replay RUN/captures/B --json RUN/captures/B.replay.json` (a file inside
the bundle directory is not covered by its checksums, so `inspect` and `replay` refuse that bundle).
"""
from __future__ import annotations

import json
import os
from pathlib import Path, PurePath
from typing import Optional

MAX_BYTES = 64 << 20


def bundle_path(run_dir: Path, capture) -> Optional[Path]:
    """The bundle an alert's `capture` names, when it is a directory inside the run directory."""
    if not isinstance(capture, str) or not capture or "\x00" in capture:
        return None
    p = PurePath(capture)
    if p.is_absolute() or ".." in p.parts:
        return None
    full = run_dir / p
    try:
        return full if full.is_dir() and not full.is_symlink() else None
    except OSError:
        return None


def _reports_in(folder: Path, seen: set) -> list[tuple[Path, dict]]:
    out = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return out
    for p in entries:
        if p.suffix != ".json" or p.name in ("manifest.json", "run.json") or p in seen:
            continue
        seen.add(p)
        try:
            if not p.is_file() or p.is_symlink() or p.stat().st_size > MAX_BYTES:
                continue
            obj = json.loads(p.read_text())
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and "reproduces" in obj:
            out.append((p, obj))
    return out


def find_verdicts(run_dir: Path, bundles: list[Path]) -> dict[Path, dict]:
    """bundle -> {"file", "report", "others"} for the bundles that have a replay report."""
    seen: set = set()
    found = _reports_in(run_dir, seen)
    for folder in {b.parent for b in bundles} | set(bundles):
        found += _reports_in(folder, seen)
    reports = dict(found)
    out: dict[Path, dict] = {}
    for b in bundles:
        mine = []
        for p, rep in found:
            cap = rep.get("capture")
            if isinstance(cap, str) and cap:
                hit = PurePath(cap.rstrip("/\\")).name == b.name
            else:
                hit = p.name.startswith(b.name)
            if hit:
                mine.append(p)
        if mine:
            mine.sort(key=lambda p: _mtime(p), reverse=True)
            out[b] = {"file": mine[0], "report": reports[mine[0]], "others": len(mine) - 1}
    return out


def _mtime(p: Path) -> float:
    try:
        return os.stat(p).st_mtime
    except OSError:
        return 0.0


def verdict_text(rep: dict) -> tuple[str, str]:
    """(short label, sentence) of a replay report: does it reproduce, where does it depart."""
    repro = rep.get("reproduces")
    first = rep.get("first_divergent_module")
    label = ("reproduces" if repro is True else "does not reproduce" if repro is False
             else "no verdict")
    words = []
    sub, v = rep.get("reproduce"), rep.get("verdict")
    if isinstance(v, dict) and isinstance(v.get("text"), str):   # {kind, text, ...}
        words.append(f"verdict ({v.get('kind', '?')}): {v['text']}")
    elif isinstance(v, str):
        words.append(v)
    elif isinstance(sub, dict) and isinstance(sub.get("verdict"), str):
        words.append(sub["verdict"])
    if isinstance(first, str) and first:
        fd = rep.get("first_divergent")
        role = fd.get("tensor") if isinstance(fd, dict) else None
        role = role if isinstance(role, str) else ""
        where = f"{first} ({role})" if role else first
        if not isinstance(v, dict):   # a verdict object names it already
            words.append(f"first divergent module: {where}")
        label += f"; departs at {where}"
    elif "first_divergent_module" in rep and not isinstance(v, dict):
        words.append("no module departs from the reference beyond the tolerance")
    up = rep.get("upcast")
    if isinstance(up, dict) and "anomaly_disappears" in up:
        what = ", ".join(str(g) for g in up.get("globs", up.get("upcast", [])) or []) or "upcast"
        words.append(f"upcast {what}: anomaly "
                     + ("disappears" if up.get("anomaly_disappears") else "persists"))
    return label, "; ".join(words)
