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
