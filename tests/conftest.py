import os

# The Triton interpreter must be switched on before any @triton.jit function is defined.
if not os.environ.get("STABILITYWATCH_REAL_TRITON"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
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
