"""benchmarks/bench_sentinel.py runs in a tiny CPU size (the kernel under the interpreter) so
that it cannot rot."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.mark.interpreter
def test_bench_sentinel_smoke(capsys):
    import bench_sentinel
    assert bench_sentinel.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| sentinel kernel (interpreter) |" in out and "| pure-torch twin |" in out
    assert "| SentinelStore.write_again (the taps' path) |" in out
