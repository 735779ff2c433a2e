"""Module-by-module comparison of the low-precision step against a float64 (or float32) replay
of the same step: outputs in forward order, then output gradients in backward order.

The reference run converts the model and the batch's floating tensors to the reference dtype
and switches autocast off inside the model, from the same start-of-step state. Both runs keep
every output and output gradient of the compared modules (memory: about two copies of the
step's activations; replay is offline). Roles with a format in Config.formats are also measured
after a saturating round trip through that format: that is the precision the monitor judged.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..hooks.tensors import float_tensors
from .metrics import errors, format_round_trip
from .rerun import Setup, force_precision


class Recorder:
    """Outputs and output gradients of named modules, in the order they are produced."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.order: list[tuple[str, str]] = []
        self.data: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.handles = [model.get_submodule(n).register_forward_hook(self._fwd(n)) for n in names]

    def _put(self, key: tuple[str, str], t: torch.Tensor) -> None:
        if key not in self.data:
            self.order.append(key)
            self.data[key] = []
        self.data[key].append(t.detach().clone())

    def _fwd(self, name: str):
        def hook(mod, args, output):
            for suffix, t in float_tensors(output):
                self._put((name, "output" + suffix), t)
                if t.requires_grad and torch.is_grad_enabled():
                    t.register_hook(lambda g, k=(name, "grad_output" + suffix):
                                    self._put(k, g) if g is not None else None)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def record(setup: Setup, names: list[str], dtype: Optional[torch.dtype]) -> Recorder:
    """Forward and backward of the captured step (no optimizer step). dtype None: as recorded;
    otherwise the whole model in `dtype` with autocast off inside it."""
    model = setup.model(dtype)
    if dtype is not None:
        force_precision(model, dtype, setup.device.type)
    rec = Recorder(model, [n for n in names if _has(model, n)])
    batch = setup.batch(dtype)
    setup.restore_rng()
    try:
        loss = setup.step_fn(model, batch)
        loss.backward()
    finally:
        rec.remove()
    return rec


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def compare(low: Recorder, ref: Recorder, config: Any, tol: float, emulate_formats: bool = True,
            progress: Optional[Callable[[int, int], None]] = None) -> list[dict]:
    """One row per (module, role) in the low-precision run's order."""
    rows = []
    for i, key in enumerate(low.order):
        if progress is not None:
            progress(i, len(low.order))
        module, role = key
        row: dict[str, Any] = {"module": module, "tensor": role, "calls": len(low.data[key])}
        if key not in ref.data or len(ref.data[key]) != len(low.data[key]):
            row.update(error="not produced the same number of times by the reference run",
                       rel_l2=math.inf, divergent=True)
            rows.append(row)
            continue
        a = torch.cat([t.reshape(-1) for t in low.data[key]])
        b = torch.cat([t.reshape(-1).to(a.device) for t in ref.data[key]])
        e = errors(a, b)
        row.update({k: e[k] for k in ("rel_l2", "sqnr_db", "cosine", "max_abs_err",
                                      "nonfinite_low", "nonfinite_ref")})
        judged = e["rel_l2"]
        fmt = config.format_for(role) if emulate_formats else None   # as the monitor judged it
        if fmt is not None:
            ef = errors(format_round_trip(a, fmt, config.scale_for(role)), b)
            row["format"] = fmt
            row["rel_l2_format"] = ef["rel_l2"]
            row["sqnr_db_format"] = ef["sqnr_db"]
            judged = max(judged, ef["rel_l2"])
        row["divergent"] = not judged <= tol     # NaN counts as divergent
        rows.append(row)
    return rows
