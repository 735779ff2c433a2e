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
