"""torchao float8 training (`torchao.float8.convert_to_float8_training`), watched at its casts.

`mon = watch_float8(model, opt, config=..., run_dir=...)` (instead of `sw.watch`), or
`attach_float8(mon)` on a monitor already watching the converted model. For every
`Float8Linear`, on sampled steps, the three casts of its matmuls are read under module `<name>`,
with the roles of stabilitywatch.integrations.fp8.Fp8Linear:
- `fp8.input`, `fp8.weight`, `fp8.grad_output`: the high-precision tensor as torchao casts it,
  at the scale torchao uses (its own `tensor_to_amax` / `amax_to_scale` on the same tensor, with
  the layer's granularity, axis, float8 dtype and power-of-two rounding, so the scale is the one
  its cast multiplies by). The overflow count is what the saturating cast clamps, the underflow
  count what it flushes to zero, in the layer's E4M3/E5M2; absmax is the amax. Rowwise
  (axiswise) scales have one value per row: these rows then hold the scaled tensor
  (`x.float() * scale`, the values the cast rounds) at scale 1.
- `fp8.scale.input`, `fp8.scale.weight`, `fp8.scale.grad_output`: the scale itself (one value,
  or one per row).
- with rowwise recipes, the casts for the other two matmuls when their configuration differs:
  `fp8.input_for_grad_weight`, `fp8.weight_for_grad_input`, `fp8.grad_output_for_grad_weight`.

Current scaling sets scale = fmt_max / amax in float32: about one cast in ten, rounding puts the
amax itself one float32 step above the format max (448.00003 for E4M3), a value the cast writes
as 448 with or without its clamp. So that such a value is not counted as saturated, the scale
recorded is then the next float32 below torchao's (a relative change of 6e-8, which moves the
underflow count only for values within that distance of the format's smallest subnormal).

`watch_float8` also sets `Config.formats` for these roles from the layers' float8 dtypes (your
own `formats` entries win), so the range detector judges them. No host sync: scales are device
tensors. Under torch.compile the reads run eagerly: on sampled steps the graph breaks at each
Float8Linear; unsampled steps trace nothing of it.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch
import torch.nn as nn

from ..hooks.taps import _eager

log = logging.getLogger("stabilitywatch")

ROLES = ("input", "weight", "grad_output")
# torchao's config attribute of each cast: (role, cast config, the tensor's axiswise dim)
_CASTS = {
    "input": ("cast_config_input", -1),
    "weight": ("cast_config_weight", 0),
    "grad_output": ("cast_config_grad_output", -1),
    "input_for_grad_weight": ("cast_config_input_for_grad_weight", 0),
    "weight_for_grad_input": ("cast_config_weight_for_grad_input", -1),
    "grad_output_for_grad_weight": ("cast_config_grad_output_for_grad_weight", 0),
}
_SECONDARY = {"input_for_grad_weight": "input", "weight_for_grad_input": "weight",
              "grad_output_for_grad_weight": "grad_output"}
_FORMAT_OF = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _torchao():
    try:
        from torchao.float8 import float8_utils
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    except ImportError as e:
        raise ImportError("stabilitywatch.integrations.torchao needs torchao: pip install "
                          "stabilitywatch[torchao]") from e
    return {"utils": float8_utils, "Granularity": ScalingGranularity, "Type": ScalingType,
            "casted": tensor_already_casted_to_fp8, "Float8Linear": Float8Linear,
            "axis": get_maybe_axiswise_dim}


def float8_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    ao = _torchao()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ao["Float8Linear"])]


def float8_formats(model: nn.Module) -> dict[str, str]:
    """Config.formats for the cast roles, from the float8 dtypes of the model's layers."""
    out: dict[str, str] = {}
    for _, mod in float8_layers(model):
        for role, (attr, _) in _CASTS.items():
            cc = getattr(mod.config, attr)
            fmt = _FORMAT_OF.get(cc.target_dtype)
            if fmt is None:
                continue
            prev = out.setdefault(f"fp8.{role}", fmt)
            if prev != fmt:
                log.warning("stabilitywatch: float8 layers cast %s to both %s and %s; the "
                            "range detector judges it as %s", role, prev, fmt, prev)
    return out


class _Cast:
    """How torchao casts one tensor of one layer: dtype, granularity, axis, rounding."""

    def __init__(self, ao: dict, config: Any, attr: str, dim: int):
        cc = getattr(config, attr)
        self.ao = ao
        self.dtype = cc.target_dtype
        self.enabled = (cc.scaling_type is not ao["Type"].DISABLED and self.dtype in _FORMAT_OF)
        self.granularity = cc.scaling_granularity
        self.axis = ao["axis"](dim, cc.scaling_granularity)
        self.pow2 = config.round_scales_to_power_of_2
        self.fmax = torch.finfo(self.dtype).max if self.enabled else 0.0
        self.rowwise = cc.scaling_granularity is ao["Granularity"].AXISWISE
        self.key = (cc.scaling_type, cc.scaling_granularity, self.dtype, self.axis)

    def scale(self, hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(torchao's scale, the scale recorded): tensor_to_scale's own two steps."""
        u = self.ao["utils"]
        amax = u.tensor_to_amax(hp, False, None, self.granularity, self.axis)
        used = u.amax_to_scale(amax, self.dtype, round_scales_to_power_of_2=self.pow2)
        # the amax one float32 step above the max is not a saturation (module docstring)
        over = amax.to(torch.float32) * used > self.fmax
        below = torch.nextafter(used, torch.zeros_like(used))
        return used, torch.where(over, below, used)


class Float8Watch:
    """The hooks on one model's Float8Linear layers; `stabilitywatch_detach()` removes them
    (the Monitor calls it at close)."""

    def __init__(self, monitor: Any, layers: list[tuple[str, nn.Module]]):
        self.mon = monitor
        self.ao = _torchao()
        self.handles: list = []
        self._failed: set[str] = set()
        self._grad_hooks: dict[str, Any] = {}
        for name, mod in layers:
            casts = {role: _Cast(self.ao, mod.config, attr, dim)
                     for role, (attr, dim) in _CASTS.items()}
            for sec, prim in _SECONDARY.items():   # the same cast as the primary: read once
                if casts[sec].key == casts[prim].key:
                    del casts[sec]
            self.handles.append(mod.register_forward_hook(self._forward_hook(name, casts)))
        self.layers = [n for n, _ in layers]

    def stabilitywatch_detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    # -- hooks ---------------------------------------------------------------------------------
    def _forward_hook(self, name: str, casts: dict):
        def eager(mod, args, output):
            self._guard(name, self._forward, name, mod, args, output, casts)
        eager = _eager(eager)

        def hook(mod, args, output):
            if self.mon.sampling:      # host integers only: unsampled steps trace nothing here
                eager(mod, args, output)
            return None
        return hook

    def _forward(self, name, mod, args, output, casts) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        if torch.is_autocast_enabled():   # as Float8Linear.forward does before its casts
            x = x.to(torch.get_autocast_gpu_dtype())
        w_t = mod.weight.t()
        for role, c in casts.items():
            if not c.enabled:
                continue
            if role.startswith("input"):
                hp = x if role == "input" else x.reshape(-1, x.shape[-1])
            elif role.startswith("weight"):
                hp = w_t
            else:
                continue
            self._observe(name, role, hp.detach(), c)
        grads = {r: c for r, c in casts.items() if r.startswith("grad_output") and c.enabled}
        if grads and torch.is_grad_enabled() and isinstance(output, torch.Tensor) \
                and output.requires_grad:
            # the bias add passes the gradient through: the output's gradient is grad_output
            output.register_hook(self._grad_hook(name, grads))

    def _grad_hook(self, name: str, casts: dict):
        hook = self._grad_hooks.get(name)
        if hook is None:
            def hook(grad):
                if grad is not None:
                    g2 = grad.detach().reshape(-1, grad.shape[-1])
                    for role, c in casts.items():
                        self._guard(name, self._observe, name, role, g2, c)
                return None
            hook = self._grad_hooks[name] = _eager(hook)
        return hook

    def _observe(self, name: str, role: str, hp: torch.Tensor, c: _Cast) -> None:
        if self.ao["casted"](hp):      # already float8 (float8 all-gather): no cast here
            self._warn(f"casted:{role}", f"{name} {role} arrives in float8 (FSDP float8 "
                       f"all-gather); its cast is not read")
            return
        used, kept = c.scale(hp)
        if c.rowwise:
            self.mon.observe(hp.to(torch.float32) * kept, f"fp8.{role}", module=name)
        else:
            self.mon.observe(hp, f"fp8.{role}", module=name, scale=kept)
        if role in ROLES:
            self.mon.observe(used, f"fp8.scale.{role}", module=name)

    def _guard(self, name: str, fn, *args) -> None:
        if name in self._failed:
            return
        try:
            fn(*args)
        except Exception as e:
            self._failed.add(name)
            log.warning("stabilitywatch: reading the float8 casts of %s failed (%s: %s); that "
                        "layer is skipped, training goes on", name, type(e).__name__, e)

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._failed:
            self._failed.add(key)
            log.warning("stabilitywatch: %s", msg)


def attach_float8(monitor: Any) -> Float8Watch:
    """Read the float8 casts of every Float8Linear in the monitor's model (module docstring).
    The hooks are removed by `monitor.close()`."""
    layers = float8_layers(monitor.model)
    if not layers:
        raise ValueError("attach_float8: the model has no torchao Float8Linear layer (convert "
                         "it with torchao.float8.convert_to_float8_training first)")
    w = Float8Watch(monitor, layers)
    monitor.observers.append(w)   # detached with the monitor's other observers at close()
    return w


def uses_float8(model: nn.Module) -> bool:
    """True when the model holds torchao Float8Linear layers (torchao is imported only when the
    program already did: a model converted by it)."""
    return "torchao.float8" in sys.modules and bool(float8_layers(model))


def float8_config(model: nn.Module, config: Any):
    """config with the cast roles' formats from the model's float8 layers (its own win)."""
    return config.replace(formats={**float8_formats(model), **dict(config.formats)})


def watch_float8(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 config: Any = None, **kwargs: Any):
    """`stabilitywatch.watch` for a torchao float8 model: the formats of the cast roles set from
    the layers' dtypes (your own `formats` entries win), and the casts read."""
    from ..config import Config
    from ..monitor import watch
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"watch_float8: config must be a stabilitywatch.Config, "
                        f"got {type(config).__name__}")
    if not float8_layers(model):
        raise ValueError("watch_float8: the model has no torchao Float8Linear layer (convert "
                         "it with torchao.float8.convert_to_float8_training first)")
    config = float8_config(model, config)
    mon = watch(model, optimizer, config=config, **kwargs)
    try:
        attach_float8(mon)
    except Exception:
        mon.close()
        raise
    return mon
