"""benchmarks/bench_cpu.py runs end to end at a tiny size (the numbers are for RESULTS.md)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_cpu  # noqa: E402


def test_bench_cpu_smoke(capsys):
    assert bench_cpu.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for table in ("tensor_stats, 65,536 values", "gradient sentinel", "HF GPT-2 (4 layers, d 128)",
                  "demo model"):
        assert table in out
    assert "| default Config() |" in out and '| preset("full") |' in out
    assert "training thread CPU ms/step" in out


def test_cpu_stats_ab_against_this_revision(capsys):
    import cpu_stats_ab
    assert cpu_stats_ab.main(["--ref", "HEAD", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if line.split("|")[1:2] and line.split("|")[1].strip() in cpu_stats_ab.DTYPES]
    assert len(rows) == len(cpu_stats_ab.DTYPES)
    for line in rows:   # both trees give a time for every dtype
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(float(v) > 0 for v in cells[1:])
