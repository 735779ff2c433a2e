"""The benchmark scripts run end to end on a tiny size, so that they cannot rot."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.interpreter
def test_kernel_accuracy_smoke(capsys):
    results = load("kernel_accuracy").main(["--smoke"])
    out = capsys.readouterr().out
    assert "| dtype | distribution |" in out and out.count("\n| fp32 |") == 3
    assert len(results) == 6
    for r in results:
        assert r["n"] == 10**5
        assert r["kernel_sumsq"] < 1e-13 and r["kernel_sum_abs"] < 1e-13, r
        assert r["kernel_std"] < (1e-8 if r["dist"] == "randn+1000" else 1e-12), r
        assert r["ref_std"] < (1e-8 if r["dist"] == "randn+1000" else 1e-12), r


if __name__ == "__main__":
    pytest.main([__file__])
