"""The statistics as a registered custom op, so that hooks inside a torch.compile'd model are
traced into the graph (no graph break) and the op runs at its place in the compiled program:
`torch.ops.stabilitywatch.accumulate_row(rows, slot, x, scale, backend)` merges the statistics
of x into rows[slot] (Triton on CUDA, the pure-torch reference elsewhere)."""
from __future__ import annotations

import torch

from .dispatch import accumulate


@torch.library.custom_op("stabilitywatch::accumulate_row", mutates_args=("rows",))
def accumulate_row(rows: torch.Tensor, slot: int, x: torch.Tensor, scale: float,
                   backend: str) -> None:
    accumulate(x, rows[slot], scale, backend)


@accumulate_row.register_fake
def _(rows, slot, x, scale, backend) -> None:
    return None
