"""Where a run writes: the run directory the user named, unless it already holds a run.

A run never appends to another run's files. `run_dir` is used as given when it is new, empty,
or holds no stabilitywatch run; otherwise the run goes to the first free sibling `run_dir-2`,
`run_dir-3`, ... (a child `run-2`, ... for a path without a name of its own, such as "."), and
one log line says where.

Every rank decides on its own, without a collective, and all ranks of one job reach the same
directory: rank r judges a directory by its own files (`run.rank{r}.json`, `alerts.rank{r}.jsonl`,
`stats.rank{r}.jsonl`; rank 0 the unsuffixed ones), and a non-zero rank also takes rank 0's files
for a previous run's when there is no `run.json` beside them, or it records another world size,
or it is older than the rank's own process (this job's rank 0 writes it first, and after every
rank has started: watch() comes after torch.distributed's rendezvous).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("stabilitywatch")

MAX_TRIES = 10_000
_START_SLACK_S = 2.0   # /proc gives the process start to the clock tick, boot time to the second


def _own_files(rank: int) -> tuple[str, ...]:
    suffix = "" if rank == 0 else f".rank{rank}"
    return (f"run{suffix}.json", f"alerts{suffix}.jsonl", f"stats{suffix}.jsonl")


def holds_run(d: Path, rank: int = 0, world_size: int = 1,
              started: Optional[float] = None) -> bool:
    """True when directory `d` holds a run that rank `rank` of this job must not append to."""
    if any((d / name).exists() for name in _own_files(rank)):
        return True
    if rank == 0 or not any((d / name).exists() for name in _own_files(0)):
        return False
    # rank 0's files: this job's when its manifest is, which rank 0 writes before anything else
    manifest = d / "run.json"
    try:
        mtime = manifest.stat().st_mtime
    except OSError:
        return True
    started = _process_start() if started is None else started
    old = started is not None and mtime < started - _START_SLACK_S
    recorded = _recorded_world(manifest, retry=not old)
    if recorded is None:   # unreadable: a broken old manifest, or one being written right now
        return old or started is None
    return old or recorded != world_size


def _recorded_world(manifest: Path, retry: bool) -> Optional[int]:
    # rank 0 may be writing the file while this rank reads it: a partial file parses after a
    # moment; an old broken one never does
    for attempt in range(20 if retry else 1):
        try:
            world = json.loads(manifest.read_text()).get("world_size")
            return world if isinstance(world, int) else -1
        except (OSError, ValueError, AttributeError):
            if attempt + 1 < (20 if retry else 1):
                time.sleep(0.05)
    return None


def fresh_run_dir(run_dir: "str | os.PathLike", rank: int = 0, world_size: int = 1,
                  started: Optional[float] = None) -> Path:
    """`run_dir`, or the first candidate after it that holds no run (see the module docstring)."""
    first = Path(run_dir)
    if not first.is_dir() or not holds_run(first, rank, world_size, started):
        return first
    for n in range(2, MAX_TRIES):
        cand = _candidate(first, n)
        if not cand.exists() or (cand.is_dir() and not holds_run(cand, rank, world_size, started)):
            (log.warning if rank == 0 else log.info)(
                "stabilitywatch: %s already holds a run; this run writes to %s", first, cand)
            return cand
    log.warning("stabilitywatch: %s and its %d numbered siblings all hold runs; appending to %s",
                first, MAX_TRIES - 2, first)
    return first


def _candidate(first: Path, n: int) -> Path:
    if first.name in ("", ".", ".."):
        return first / f"run-{n}"
    return first.with_name(f"{first.name}-{n}")


def _process_start() -> Optional[float]:
    """This process's start, in seconds since the epoch (Linux: /proc); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def write_manifest(run_dir: Path, rank: int, info: dict) -> None:
    """run.json (rank 0) or run.rank{r}.json, replaced whole, never cut: on a full disk the one
    written before stays. A failure is one warning; the run goes on."""
    name = "run.json" if rank == 0 else f"run.rank{rank}.json"
    path, tmp = run_dir / name, run_dir / f".{name}.tmp"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(json.dumps(info, indent=2))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        log.warning("stabilitywatch: cannot write %s (%s); going on without it", run_dir / name, e)
