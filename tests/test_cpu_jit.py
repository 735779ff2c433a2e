"""The CPU path's compiled loops when their compile fails: one warning, the numpy passes answer,
and nothing waits for loops that will never come."""
from __future__ import annotations

import time

import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch.stats import cpu, cpu_jit
from stabilitywatch.stats.reference import reference_row


def test_a_failed_compile_warns_and_leaves_the_numpy_passes(monkeypatch):
    if not cpu_jit.ENABLED:
        pytest.skip("numba is not installed (or STABILITYWATCH_CPU_JIT=0): nothing to compile")
    monkeypatch.setattr(cpu_jit, "_ready", {})
    monkeypatch.setattr(cpu_jit, "_warming", False)
    monkeypatch.setattr(cpu_jit, "_failed", False)

    def broken():
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(cpu_jit, "_get", broken)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="compiled CPU statistics are off.*no LLVM here"):
        assert cpu_jit.wait(timeout=60) is False
    assert time.monotonic() - t0 < 30
    assert not cpu_jit.ready(cpu._F32.float)
    x = torch.randn(5000, dtype=torch.float64) * 7
    x[::97] = float("nan")
    assert_rows_match(cpu.cpu_row(x), reference_row(x), label="after a failed compile")
