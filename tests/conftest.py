import os

# The Triton interpreter must be switched on before any @triton.jit function is defined.
if not os.environ.get("STABILITYWATCH_REAL_TRITON"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")


def _threads_per_worker() -> int:
    """Cores per pytest-xdist worker. With one OpenMP pool of all the cores in every worker,
    the workers' pools take turns on the same cores, and a parallel region waits at its
    barrier for a thread that is descheduled: on CI's 2 cores with `-n auto`, the suite runs
    ~15 % longer. Outside xdist: 0 (torch's default)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // workers)


# Set before torch is imported (its OpenMP pool reads it), and inherited by the processes the
# tests start (CLI runs, distributed ranks), which share the worker's cores too. A value the
# user set is kept.
_THREADS = 0 if "OMP_NUM_THREADS" in os.environ else _threads_per_worker()
if _THREADS:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

if _THREADS:
    torch.set_num_threads(_THREADS)  # in case a plugin imported torch before this file

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    # The `slow` tests (8-10 s each) run first. pytest-xdist's worksteal gives each worker a
    # contiguous share of this order and moves tests from the end of one worker's queue to an
    # idle worker, but never the last two: collected last (tests/zoo), they held one worker
    # for up to 15 s after the other had finished.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    # Kernels on CPU tensors run only under the Triton interpreter. With real Triton
    # (STABILITYWATCH_REAL_TRITON=1, for the GPU files) those tests would fail with "cpu
    # tensor?": they are skipped, naming why; CI runs them with the interpreter.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 "
                                   "(off under STABILITYWATCH_REAL_TRITON=1)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)
