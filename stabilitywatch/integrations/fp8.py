"""An FP8 linear layer with delayed scaling that the monitor can see into.

Forward: activations and weights cast to E4M3 with per-tensor scales computed from an amax history
(scale = 448 / max(history) / 2**margin; the current amax on the first step), one
`torch._scaled_mm` on CUDA. Backward: the output gradient cast to E5M2 the same way, two more FP8
matmuls. On the CPU the matmuls are emulated (dequantise, then matmul) so that tests run anywhere.

While watched, each cast reports to the monitor (roles under module `<name>`):
- `fp8.input`, `fp8.weight`, `fp8.grad_output`: the high-precision tensor at the scale actually
  used, so overflow counts are the values the cast saturates and underflow counts those it
  flushes to zero;
- `fp8.input.e4m3`, `fp8.weight.e4m3`, `fp8.grad_output.e5m2`: the FP8 tensors themselves;
- `fp8.amax_history.input` / `.weight` / `.grad_output`: the amax history that drives each scale.
Pair with `Config(formats={"fp8.input": "e4m3", "fp8.weight": "e4m3", "fp8.grad_output": "e5m2"})`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

E4M3_MAX = 448.0
E5M2_MAX = 57344.0

Observe = Callable[..., None]  # observe(tensor, role, scale=...)


def _scale(history: torch.Tensor, amax: torch.Tensor, fmax: float, margin: int) -> torch.Tensor:
    past = history.max()
    ref = torch.where(past > 0, past, amax)          # first step: current scaling
    ref = torch.where(ref > 0, ref, torch.ones_like(ref))
    return (fmax / ref / (2.0 ** margin)).to(torch.float32)


def _push(history: torch.Tensor, amax: torch.Tensor) -> None:
    history.copy_(torch.cat([amax.reshape(1).to(history.dtype), history[:-1]]))


def _cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)  # saturating cast


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 / sa) @ (b8 / sb): FP8 tensor cores on CUDA, emulated elsewhere."""
    if a8.is_cuda:
        return torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                                out_dtype=out_dtype)
    return ((a8.float() / sa) @ (b8.float() / sb)).to(out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, mod):
        out_dtype = torch.bfloat16 if x2.is_cuda else torch.float32
        ax, aw = x2.detach().abs().max().float(), weight.detach().abs().max().float()
        sx = _scale(mod.amax_input, ax, E4M3_MAX, mod.margin)
        sw = _scale(mod.amax_weight, aw, E4M3_MAX, mod.margin)
        x8 = _cast(x2, sx, E4M3_MAX, torch.float8_e4m3fn)
        w8 = _cast(weight, sw, E4M3_MAX, torch.float8_e4m3fn)
        mod._report(x2, x8, sx, mod.amax_input, "input", "e4m3")
        mod._report(weight, w8, sw, mod.amax_weight, "weight", "e4m3")
        _push(mod.amax_input, ax)
        _push(mod.amax_weight, aw)
        ctx.save_for_backward(x8, w8, sx, sw)
        ctx.mod = mod
        # [M, in] @ [in, out]: the second operand column-major, as _scaled_mm wants
        return _mm(x8, w8.t(), sx, sw, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, w8, sx, sw = ctx.saved_tensors
        mod = ctx.mod
        g2 = grad.reshape(-1, grad.shape[-1])
        ag = g2.detach().abs().max().float()
        sg = _scale(mod.amax_grad, ag, E5M2_MAX, mod.margin)
        g8 = _cast(g2, sg, E5M2_MAX, torch.float8_e5m2)
        mod._report(g2, g8, sg, mod.amax_grad, "grad_output", "e5m2")
        _push(mod.amax_grad, ag)
        out_dtype = torch.bfloat16 if g2.is_cuda else torch.float32
        # dX = G @ W: [M, out] @ [out, in];  dW = G^T @ X: [out, M] @ [M, in]
        gx = _mm(g8, w8.t().contiguous().t(), sg, sw, out_dtype)
        gw = _mm(g8.t().contiguous(), x8.t().contiguous().t(), sg, sx, torch.float32)
        return gx.to(grad.dtype), gw.to(ctx.mod.weight.dtype), None


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 history: int = 16, margin: int = 0):
        super().__init__()
        lin = nn.Linear(in_features, out_features, bias=bias)
        self.weight = lin.weight
        self.bias = lin.bias
        self.margin = margin
        for role in ("input", "weight", "grad"):
            self.register_buffer(f"amax_{role}", torch.zeros(history), persistent=True)
        self._observe: Optional[Observe] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self)
        y = y.view(*x.shape[:-1], -1)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    # -- the monitor's side (duck-typed: Monitor looks for these two methods) -------------------
    def stabilitywatch_attach(self, observe: Observe) -> None:
        self._observe = observe

    def stabilitywatch_detach(self) -> None:
        self._observe = None

    def _report(self, hp, q, scale, history, role, fmt) -> None:
        if self._observe is None:
            return
        self._observe(hp.detach(), f"fp8.{role}", scale=scale)
        self._observe(q, f"fp8.{role}.{fmt}")
        self._observe(history, f"fp8.amax_history.{role}")
