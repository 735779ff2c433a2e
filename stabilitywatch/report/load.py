"""Reading a run directory for the report: streaming, bounded memory, tolerant of what runs leave.

Every file is read line by line; a line that does not parse (a cut last line, a disk that filled
up) is counted and skipped. Non-finite numbers arrive as the strings "nan", "inf", "-inf". The
statistics are read in two passes: the first (a regex per line, no JSON) finds the steps and
the (module, role) keys, so the second can fill fixed-size grids of at most
`max_steps` x `max_modules` cells per role; several steps per column keep the largest value.
"""
from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

DEFAULT_ROLES = ("output", "grad_output", "weight", "grad")
WHOLE_MODEL = ("loss", "grad_norm")
FORMATS = ("e4m3", "e5m2", "fp16")
DEFAULT_FORMAT = "fp16"
_RANK_FILE = re.compile(r"^(run|alerts|stats)(?:\.rank(\d+))?\.(json|jsonl)$")
_STEP = re.compile(r'"step"\s*:\s*(-?\d+)')
_MODULE = re.compile(r'"module"\s*:\s*("(?:[^"\\]|\\.)*")')
_TENSOR = re.compile(r'"tensor"\s*:\s*("(?:[^"\\]|\\.)*")')


def num(v) -> float:
    """A JSON value as a float: numbers, the strings "nan"/"inf"/"-inf"; anything else NaN."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan


def rank_files(run_dir: Path, kind: str) -> list[tuple[int, Path]]:
    """(rank, path) of `kind` ("run", "alerts", "stats") files, rank 0 (unsuffixed) first."""
    out = []
    for p in run_dir.iterdir():
        m = _RANK_FILE.match(p.name)
        if m and m.group(1) == kind and p.is_file():
            out.append((int(m.group(2) or 0), p))
    return sorted(out)


def iter_json_lines(path: Path, bad: list, keep=None) -> Iterator[dict]:
    """The JSON objects of a .jsonl file; unreadable lines are appended to `bad` as (path, line).
    `keep(line)`, when given, is asked first: False skips the line without parsing it."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip() or (keep is not None and not keep(raw)):
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                bad.append((path.name, n))
                continue
            if isinstance(obj, dict):
                yield obj
            else:
                bad.append((path.name, n))


def read_manifest(run_dir: Path) -> tuple[Optional[Path], dict]:
    for _, p in rank_files(run_dir, "run"):
        try:
            obj = json.loads(p.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            return p, obj
    return None, {}


def read_alerts(run_dir: Path, bad: list) -> list[dict]:
    alerts = []
    for rank, p in rank_files(run_dir, "alerts"):
        for i, a in enumerate(iter_json_lines(p, bad)):
            a.setdefault("rank", rank)
            for k in ("step", "rank", "incident", "module", "capture"):   # grouped and looked up
                if isinstance(a.get(k), (list, dict)):
                    a[k] = json.dumps(a[k])
            a["_order"] = (rank, i)
            alerts.append(a)
    alerts.sort(key=lambda a: (num(a.get("step")) if math.isfinite(num(a.get("step"))) else 0,
                               a["_order"]))
    return alerts


@dataclass
class Grid:
    """One role's module x column grid; each stat a float array (NaN where nothing was read)."""
    role: str
    modules: list[str]
    total_modules: int
    stats: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class RunData:
    run_dir: Path
    manifest_path: Optional[Path] = None
    manifest: dict = field(default_factory=dict)
    alerts: list = field(default_factory=list)
    stats_files: list = field(default_factory=list)
    stats_lines: int = 0
    bad_lines: list = field(default_factory=list)
    loss: dict = field(default_factory=dict)        # step -> value (NaN/inf kept)
    grad_norm: dict = field(default_factory=dict)
    columns: list = field(default_factory=list)     # first step of each heatmap column
    step_bin: int = 1                               # recorded steps per column
    col_of: dict = field(default_factory=dict)      # recorded step -> column
    heat_steps: int = 0                             # distinct steps with heatmap rows
    grids: dict = field(default_factory=dict)       # role -> Grid
    formats: dict = field(default_factory=dict)     # role -> [format, ...]
    formats_in_stats: list = field(default_factory=list)
    roles_in_stats: list = field(default_factory=list)


def _alert_modules(alerts: list) -> set:
    return {a.get("module") for a in alerts
            if a.get("severity") in ("warning", "critical") and isinstance(a.get("module"), str)}


def _formats_for(role: str, config: dict, override: Optional[list]) -> list[str]:
    if override:
        return list(override)
    fmts = config.get("formats") if isinstance(config, dict) else None
    if isinstance(fmts, dict):
        for glob, fmt in fmts.items():
            if isinstance(glob, str) and fnmatch.fnmatchcase(role, glob) and fmt in FORMATS:
                return [fmt]
    return [DEFAULT_FORMAT]


def _pick(names: list[str], keep: set, cap: int) -> list[str]:
    """At most `cap` of `names`, in order: the ones in `keep` first, the rest evenly spaced."""
    if len(names) <= cap:
        return names
    must = [n for n in names if n in keep][:cap]
    rest = [n for n in names if n not in keep]
    room = cap - len(must)
    if room > 0 and rest:
        idx = np.unique(np.linspace(0, len(rest) - 1, room).round().astype(int))
        must += [rest[i] for i in idx]
    chosen = set(must)
    return [n for n in names if n in chosen]


def _scan(files: list[Path]) -> tuple[dict, set, int]:
    """First pass, no JSON: role -> modules in order of first appearance; heatmap steps; lines."""
    order: dict[str, dict[str, None]] = {}
    steps: set = set()
    lines = 0
    for p in files:
        with open(p, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", "replace")
                ms, mm, mt = _STEP.search(line), _MODULE.search(line), _TENSOR.search(line)
                if not (ms and mm and mt):
                    continue
                lines += 1
                try:
                    module, role = _literal(mm.group(1)), _literal(mt.group(1))
                except ValueError:
                    continue
                if role in WHOLE_MODEL or '"absmax"' not in line:
                    continue
                order.setdefault(role, {}).setdefault(module, None)
                steps.add(int(ms.group(1)))
    return {r: list(m) for r, m in order.items()}, steps, lines


def load_run(run_dir: Path, roles: Optional[list] = None, formats: Optional[list] = None,
             max_modules: int = 60, max_steps: int = 240) -> RunData:
    d = RunData(run_dir=run_dir)
    d.manifest_path, d.manifest = read_manifest(run_dir)
    d.alerts = read_alerts(run_dir, d.bad_lines)
    files = [p for _, p in rank_files(run_dir, "stats")]
    d.stats_files = files
    order, steps, d.stats_lines = _scan(files)
    d.roles_in_stats = list(order)
    if roles:
        missing = [r for r in roles if r not in order]
        if missing and order:
            raise ValueError(f"--roles: {missing[0]!r} has no statistics in this run (roles "
                             f"read: {', '.join(r for r in order)})")
        chosen = [r for r in roles if r in order]
    else:
        chosen = [r for r in DEFAULT_ROLES if r in order]
        if not chosen:   # a selection of other roles: the first few that were read
            chosen = [r for r in order if not r.startswith(("drift.", "shadow"))][:4]
    config = d.manifest.get("config") if isinstance(d.manifest.get("config"), dict) else {}
    keep = _alert_modules(d.alerts)
    srt = sorted(steps)
    d.heat_steps = len(srt)
    # consecutive recorded steps share a column: no empty columns when steps are sampled
    d.step_bin = max(1, -(-len(srt) // max_steps))
    d.columns = srt[::d.step_bin]
    d.col_of = {s: i // d.step_bin for i, s in enumerate(srt)}
    col_of = d.col_of.get
    ncol = len(d.columns)
    row_of = {}
    for role in chosen:
        mods = _pick(order[role], keep, max_modules)
        d.formats[role] = _formats_for(role, config, formats)
        g = Grid(role, mods, len(order[role]))
        names = ["absmax", "nonfinite"] + [f"{f}_{k}_frac" for f in d.formats[role]
                                           for k in ("underflow", "overflow")]
        g.stats = {n: np.full((len(mods), ncol), np.nan) for n in names}
        d.grids[role] = g
        row_of[role] = {m: i for i, m in enumerate(mods)}
    fmts_seen: set = set()
    junk: list = []
    for p in files:
        for rec in iter_json_lines(p, junk, keep=lambda line: _wanted(line, row_of)):
            role, module, st = rec.get("tensor"), rec.get("module"), rec.get("stats")
            step = rec.get("step")
            if not isinstance(st, dict) or not isinstance(step, int):
                continue
            if module == "" and role in WHOLE_MODEL:
                _curve_point(d.loss if role == "loss" else d.grad_norm, step, role, st)
                continue
            if len(fmts_seen) < len(FORMATS):
                fmts_seen.update(f for f in FORMATS if f"{f}_overflow_frac" in st)
            i = row_of.get(role, {}).get(module)
            j = col_of(step) if ncol else None
            if i is None or j is None:
                continue
            g = d.grids[role]
            for name, arr in g.stats.items():
                if name == "nonfinite":
                    v = num(st.get("nan", 0)) + num(st.get("posinf", 0)) + num(st.get("neginf", 0))
                else:
                    v = num(st.get(name))
                if not math.isnan(v) and not (arr[i, j] >= v):
                    arr[i, j] = v
    d.bad_lines += junk
    d.formats_in_stats = [f for f in FORMATS if f in fmts_seen]
    return d


def _literal(s: str) -> str:
    """A JSON string literal's value (most need no unescaping)."""
    return s[1:-1] if "\\" not in s else json.loads(s)


def _wanted(raw: bytes, row_of: dict) -> bool:
    """Whether a statistics line can matter (parsing every line dominates the time otherwise);
    a line whose keys the regexes do not find is parsed, to be judged whole."""
    line = raw.decode("utf-8", "replace")
    mm, mt = _MODULE.search(line), _TENSOR.search(line)
    if not (mm and mt):
        return True
    try:
        module, role = _literal(mm.group(1)), _literal(mt.group(1))
    except ValueError:
        return True
    return (module == "" and role in WHOLE_MODEL) or module in row_of.get(role, ())


def _curve_point(curve: dict, step: int, role: str, st: dict) -> None:
    if step in curve:   # the lowest rank's value (files are read rank 0 first)
        return
    if role == "loss":
        bad = num(st.get("nan", 0)) + num(st.get("posinf", 0)) + num(st.get("neginf", 0))
        v = num(st.get("mean"))
        if bad > 0 or not math.isfinite(v):
            v = math.nan if num(st.get("nan", 0)) > 0 else math.inf
    else:
        v = num(st.get("l2norm"))
        if num(st.get("nonfinite", 0)) > 0 and math.isfinite(v):
            v = math.inf
    curve[step] = v
