"""Role-by-role comparison of the low-precision step against a float64 (or float32) replay of the
same step: every role the monitor reads (parameters, outputs, the loss, output gradients,
parameter gradients, the optimizer's state and its update), in dataflow order.

Both runs start from the same start-of-step state and run forward, backward and the optimizer
step. The reference run converts the model, its optimizer state and the batch's floating tensors
to the reference dtype and switches autocast off inside the model. Each run keeps one copy of
every compared tensor of the compared modules (memory: about two copies of the step's
activations, parameters, gradients and optimizer state; replay is offline). Roles with a format in
Config.formats are also measured after a saturating round trip through that format: that is the
precision the monitor judged.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from ..hooks.taps import param_role
from ..hooks.tensors import float_tensors
from .metrics import errors, format_round_trip
from .rerun import LOW_DTYPES, Setup, force_precision


def dataflow_key(module: str, role: str, forward: dict[str, int]) -> tuple:
    """Sort key of a (module, role) in dataflow order: the batch; then, module by module in
    forward order, its parameters before its outputs; the loss; then, module by module in
    backward order, its output gradients before its parameter gradients; the optimizer's
    state; its update. Sorting rows by it (stably) puts every tensor after the ones it is
    computed from, so the first departing row is where a departure starts."""
    i = forward.get(module, len(forward))
    if role == "loss":
        return (2, 0, 0)
    if module == "" and role == "input":
        return (0, 0, 0)
    if role.startswith("grad_output"):
        return (3, -i, 0)
    if role == "grad" or role.startswith("grad."):
        return (3, -i, 1)
    if role == "optim.update" or role.startswith("optim.update."):
        return (5, i, 0)
    if role.startswith("optim."):
        return (4, i, 0)
    if role.startswith("output"):
        return (1, i, 1)
    return (1, i, 0)        # parameters (weight, bias...), inputs: before the outputs they feed


def forward_order(keys: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Module -> position, in the order of the modules' first output among `keys` (execution
    order, as rows and recordings are made)."""
    out: dict[str, int] = {}
    for module, role in keys:
        if role.startswith("output") and module not in out:
            out[module] = len(out)
    return out


def in_dataflow_order(keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
    fwd = forward_order(keys)
    return sorted(keys, key=lambda k: dataflow_key(k[0], k[1], fwd))


class Recorder:
    """Copies of every role of named modules over one step, in the order they are produced."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.order: list[tuple[str, str]] = []
        self.data: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.dtypes: dict[tuple[str, str], torch.dtype] = {}
        self.out_dtype: dict[str, torch.dtype] = {}    # module -> dtype of its first output
        mods = [(n, model.get_submodule(n)) for n in names]
        self.handles = [m.register_forward_hook(self._fwd(n)) for n, m in mods]
        # parameters of the compared modules, each once (a tied weight keeps its first owner)
        self.params: list[tuple[str, str, nn.Parameter]] = []
        seen: set[int] = set()
        for n, m in mods:
            for pn, p in m.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((n, pn, p))
                    self._put((n, param_role(pn, "weight")), p)

    def _put(self, key: tuple[str, str], t: torch.Tensor) -> None:
        if key not in self.data:
            self.order.append(key)
            self.data[key] = []
            self.dtypes[key] = t.dtype
        self.data[key].append(t.detach().clone())

    def _fwd(self, name: str):
        def hook(mod, args, output):
            for suffix, t in float_tensors(output):
                self.out_dtype.setdefault(name, t.dtype)
                self._put((name, "output" + suffix), t)
                if t.requires_grad and torch.is_grad_enabled():
                    t.register_hook(lambda g, k=(name, "grad_output" + suffix):
                                    self._put(k, g) if g is not None else None)
        return hook

    def loss(self, loss: torch.Tensor) -> None:
        self._put(("", "loss"), loss)

    def grads(self) -> None:
        for n, pn, p in self.params:
            if p.grad is not None:
                self._put((n, param_role(pn, "grad")), p.grad)

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        for n, pn, p in self.params:
            for k, v in (opt.state.get(p) or {}).items():
                # per-element state only (exp_avg, exp_avg_sq, momentum_buffer...), as the taps
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == p.numel():
                    self._put((n, param_role(pn, f"optim.{k}")), v)
        for n, pn, p in self.params:
            before = self.data[(n, param_role(pn, "weight"))][0]
            self._put((n, param_role(pn, "optim.update")), p.detach() - before)

    def compute_dtype(self, module: str, role: str) -> torch.dtype:
        """The precision a role was computed in: a parameter's gradient, state and update in
        its module's (its output's dtype under autocast), anything else in its own."""
        own = self.dtypes[(module, role)]
        out = self.out_dtype.get(module)
        if out in LOW_DTYPES and not role.startswith(("output", "grad_output")):
            return out
        return own

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def record(setup: Setup, names: list[str], dtype: Optional[torch.dtype]) -> Recorder:
    """Forward, backward and the optimizer step of the captured step. dtype None: as recorded;
    otherwise the whole model (and its optimizer state) in `dtype`, autocast off inside it."""
    model = setup.model(dtype)
    if dtype is not None:
        force_precision(model, dtype, setup.device.type)
    opt = setup.optimizer(model)
    rec = Recorder(model, [n for n in names if _has(model, n)])
    batch = setup.batch(dtype)
    setup.restore_rng()
    try:
        loss = setup.step_fn(model, batch)
        rec.loss(loss)
        loss.backward()
    finally:
        rec.remove()
    rec.grads()
    if opt is not None:
        opt.step()
        rec.after_step(opt)
    return rec


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def compare(low: Recorder, ref: Recorder, config: Any, tol: float, emulate_formats: bool = True,
            progress: Optional[Callable[[int, int], None]] = None) -> list[dict]:
    """One row per (module, role) of the low-precision run, in dataflow order."""
    rows = []
    keys = in_dataflow_order(low.order)
    for i, key in enumerate(keys):
        if progress is not None:
            progress(i, len(keys))
        module, role = key
        row: dict[str, Any] = {"module": module, "tensor": role, "calls": len(low.data[key]),
                               "dtype": str(low.compute_dtype(module, role)).replace("torch.", "")}
        if key not in ref.data or len(ref.data[key]) != len(low.data[key]):
            row.update(error="not produced the same number of times by the reference run",
                       rel_l2=math.inf, divergent=True)
            rows.append(row)
            continue
        a = torch.cat([t.reshape(-1) for t in low.data[key]])
        b = torch.cat([t.reshape(-1).to(a.device) for t in ref.data[key]])
        e = errors(a, b)
        row.update({k: e[k] for k in ("rel_l2", "sqnr_db", "cosine", "max_abs_err",
                                      "nonfinite_low", "nonfinite_ref", "absmax_low",
                                      "absmax_ref")})
        judged = e["rel_l2"]
        fmt = config.format_for(role) if emulate_formats else None   # as the monitor judged it
        if fmt is not None:
            ef = errors(format_round_trip(a, fmt, config.scale_for(role)), b)
            row["format"] = fmt
            row["scale"] = config.scale_for(role)
            row["rel_l2_format"] = ef["rel_l2"]
            row["sqnr_db_format"] = ef["sqnr_db"]
            judged = max(judged, ef["rel_l2"])
        row["divergent"] = not judged <= tol     # NaN counts as divergent
        rows.append(row)
    return rows
