"""The CPU path's compiled loops around their compile: when it fails, one warning, the numpy
passes answer and nothing waits for loops that will never come; a child forked mid-compile
compiles its own."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rowcheck import assert_rows_match
from stabilitywatch.stats import cpu, cpu_jit
from stabilitywatch.stats.reference import reference_row


@pytest.fixture
def uncompiled(monkeypatch):
    """The process as before its first CPU row: nothing compiled, no compile thread."""
    if not cpu_jit.ENABLED:
        pytest.skip("numba is not installed (or STABILITYWATCH_CPU_JIT=0): nothing to compile")
    monkeypatch.setattr(cpu_jit, "_ready", {})
    monkeypatch.setattr(cpu_jit, "_warming", False)
    monkeypatch.setattr(cpu_jit, "_failed", False)


def test_a_failed_compile_warns_and_leaves_the_numpy_passes(uncompiled, monkeypatch):

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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_mid_compile_compiles_its_own_and_never_waits_on_the_parents_lock(
        uncompiled, monkeypatch):
    # the parent as its compile thread leaves it mid-import: the import lock held, not ready
    monkeypatch.setattr(cpu_jit, "_warming", True)
    x = torch.randn(3000) * 5
    want = reference_row(x)
    with cpu_jit._import_lock:
        pid = os.fork()
        if pid == 0:   # the child: rows at once (numpy), then its own compiled loops
            code = 1
            try:
                signal.alarm(60)
                assert_rows_match(cpu.cpu_row(x), want, label="child, first row")
                assert cpu_jit.wait(timeout=50)
                assert_rows_match(cpu.cpu_row(x), want, label="child, compiled")
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_rows_while_numba_imports_do_not_wait_for_it(uncompiled):
    x = torch.randn(3000) * 5
    with cpu_jit._import_lock:   # as the compile thread holds it while numba imports
        t0 = time.monotonic()
        for _ in range(3):
            assert_rows_match(cpu.cpu_row(x), reference_row(x), label="while compiling")
        assert time.monotonic() - t0 < 2.0
    assert cpu_jit.wait(timeout=60)
