"""Error of a low-precision tensor against a higher-precision reference, computed in float64
(DESIGN habit 7): relative L2 error, SQNR in dB, cosine similarity, max absolute error.

Non-finite values: positions where both tensors hold the same Inf, or both NaN, agree; any
other position where either is non-finite makes the error infinite (a value that overflowed in
low precision and not in the reference is the strongest divergence there is)."""
from __future__ import annotations

import math

import torch

from ..formats import spec


def errors(low: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Also the largest finite |x| of each (absmax_low, absmax_ref) and their non-finite counts."""
    a = low.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(device=a.device, dtype=torch.float64).reshape(-1)
    if a.numel() != b.numel():
        raise ValueError(f"shapes differ: {tuple(low.shape)} vs {tuple(ref.shape)}")
    same = (a == b) | (a.isnan() & b.isnan())
    finite = a.isfinite() & b.isfinite()
    bad = int((~same & ~finite).sum())
    nonfinite_low = int((~a.isfinite()).sum())
    af = torch.where(finite, a, 0.0)
    bf = torch.where(finite, b, 0.0)
    ref_norm = float(bf.norm())
    out = {"numel": a.numel(), "nonfinite_low": nonfinite_low,
           "nonfinite_ref": int((~b.isfinite()).sum()), "ref_norm": ref_norm,
           "absmax_low": _absmax(a), "absmax_ref": _absmax(b)}
    if bad:
        return {**out, "rel_l2": math.inf, "sqnr_db": -math.inf, "cosine": math.nan,
                "max_abs_err": math.inf}
    d = torch.where(same, 0.0, af - bf)
    err = float(d.norm())
    rel = err / ref_norm if ref_norm > 0 else (0.0 if err == 0 else math.inf)
    sqnr = math.inf if err == 0 else (20 * math.log10(ref_norm / err) if ref_norm > 0 else -math.inf)
    na = float(af.norm())
    cos = float(af @ bf) / (na * ref_norm) if na > 0 and ref_norm > 0 else (
        1.0 if na == ref_norm == 0 else 0.0)
    return {**out, "rel_l2": rel, "sqnr_db": sqnr, "cosine": cos,
            "max_abs_err": float(d.abs().max()) if d.numel() else 0.0}


def _absmax(x: torch.Tensor) -> float:
    """Largest finite |x| (0 when there is none)."""
    f = x[x.isfinite()]
    return float(f.abs().max()) if f.numel() else 0.0


def format_round_trip(x: torch.Tensor, fmt: str, scale: float = 1.0) -> torch.Tensor:
    """x as it would come back from a saturating cast to `fmt` at `scale` (finite values are
    clamped to the format's max, as FP8 training recipes do; NaN/Inf stay as they are)."""
    f = spec(fmt)
    y = x.detach().to(torch.float32) * scale
    q = y.clamp(-f.max, f.max).to(f.torch_dtype).to(torch.float64) / scale
    return torch.where(y.isfinite(), q, x.detach().to(torch.float64))
