"""The `RowBackend` (stats/backend.py) that launches the Triton kernels where they run and the
pure-torch reference elsewhere, and the one-off `tensor_stats`."""
from __future__ import annotations

import functools

import torch

from ..stats.backend import RowBackend
from ..stats.derive import derive
from ..stats.layout import N_STATS
from . import dispatch


@functools.lru_cache(maxsize=1)
def _sentinel_module():
    try:
        from . import sentinel
    except Exception:  # no triton, or one that does not import here
        return None
    return sentinel


def kernel_backend(name: str = "auto") -> RowBackend:
    """name: "auto" (the kernels on CUDA), "triton" (the kernels wherever they run, the
    interpreter included; an error where triton does not import) or "torch" (the reference)."""
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"stabilitywatch: backend must be 'auto', 'triton' or 'torch', "
                         f"got {name!r}")
    return RowBackend(name=name, accumulate=dispatch.accumulate,
                      accumulate_many=dispatch.accumulate_many, batchable=dispatch.batchable,
                      tileable=dispatch.tileable, viewable=dispatch.viewable,
                      sentinel_launchable=_sentinel_launchable, sentinel_launch=_sentinel_launch,
                      accumulate_each=dispatch.accumulate_each,
                      host_scale_of=dispatch.host_scale_of)


def _sentinel_launchable(g: torch.Tensor, name: str) -> bool:
    mod = _sentinel_module()
    return dispatch.triton_usable(g.device, name) and mod is not None and mod.launchable(g)


def _sentinel_launch(grads: list, out: torch.Tensor, rows: list):
    return _sentinel_module().sentinel_launch([dispatch.flat_view(g) for g in grads], out, rows)


def tensor_stats(t: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    """One-off statistics of a tensor, synchronous. The same numbers the hooks log: the Triton
    kernel on CUDA when it is available, the pure-torch reference otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_stats expects a torch.Tensor, got {type(t).__name__}")
    row = dispatch.compute_row(t, scale)
    assert row.shape == (N_STATS,)
    return derive(row.cpu().numpy(), float(scale))  # sync-ok: tensor_stats is synchronous
