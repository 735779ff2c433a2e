"""benchmarks/bench_dist.py runs end to end in its --smoke mode (2 processes, gloo, CPU), so
that the 2-GPU measurement cannot rot. A separate interpreter with a deadline: a hang fails."""
from __future__ import annotations

import csv
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_dist_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    # its own session, so that on a hang the benchmark and the ranks it spawned go together
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "bench_dist.py"),
                             "--smoke", "--out", str(tmp_path)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("bench_dist.py --smoke did not finish within 180 s")
    assert proc.returncode == 0, stderr[-3000:]
    assert "| rank0, gloo side group, flush every step |" in stdout
    rows = list(csv.DictReader(open(tmp_path / "bench_dist.csv")))
    by = {r["config"]: r for r in rows}
    assert set(by) == {"no monitor", "per-rank, no collective",
                       "rank0, gloo side group, flush every step",
                       "rank0, gloo side group, flush every 10",
                       "rank0, gloo, all-gather, flush every step"}
    assert int(by["rank0, gloo side group, flush every step"]["flushes"]) == 3
    assert float(by["rank0, gloo side group, flush every step"]["collective_ms"]) > 0
    assert int(by["per-rank, no collective"]["flushes"]) == 0
    red, gat = by["rank0, gloo side group, flush every step"], \
        by["rank0, gloo, all-gather, flush every step"]
    assert int(gat["flushes"]) == 3 and float(gat["collective_ms"]) > 0
    # 2 ranks: the all-gather's receive is twice its send; a reduction's equals its send
    assert float(gat["received_per_rank"]) == 2 * float(gat["bytes_per_rank"])
    assert float(red["received_per_rank"]) == float(red["bytes_per_rank"]) > 0
