"""Pure-torch statistics row: the CPU path, the fallback, and the test oracle of the kernels.

It does the same arithmetic as the Triton kernel (values upcast to float32, y = x * scale in
float32, float64 sums), so counts and min/max agree exactly and sums to rounding. It never
syncs with the host: no item()/tolist(), no boolean-mask indexing, histogram by scatter_add.
"""
from __future__ import annotations

import torch

from ..formats import FORMATS, ROW_FORMATS
from .layout import FMT_BASE, HIST_BINS, HIST_EMIN, N_STATS, ROW_DTYPE, Stat, init_row_tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                    torch.float8_e5m2, torch.float64)


def is_supported(t: torch.Tensor) -> bool:
    return t.dtype in SUPPORTED_DTYPES


def reference_row(t: torch.Tensor, scale: "float | torch.Tensor" = 1.0) -> torch.Tensor:
    """The float64 statistics row of t (on t's device)."""
    if not is_supported(t):
        raise TypeError(f"stabilitywatch: unsupported tensor dtype {t.dtype}")
    if t.numel() == 0:
        return init_row_tensor(t.device)
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.detach().reshape(-1).to(work)
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(device=x.device, dtype=work).reshape(())
    else:
        s = float(scale)
    inf = float("inf")

    nan = x.isnan()
    posinf = x == float("inf")
    neginf = x == float("-inf")
    finite = x.isfinite()
    a = x.abs()
    nonzero = finite & (a != 0)
    y = (x * s).abs()

    def count(mask: torch.Tensor) -> torch.Tensor:
        return mask.sum(dtype=torch.int64).to(ROW_DTYPE)

    xf = torch.where(finite, x, torch.zeros_like(x))
    vals = [None] * N_STATS
    vals[Stat.NUMEL] = torch.full((), float(x.numel()), dtype=ROW_DTYPE, device=x.device)
    vals[Stat.NAN] = count(nan)
    vals[Stat.POSINF] = count(posinf)
    vals[Stat.NEGINF] = count(neginf)
    vals[Stat.ZEROS] = count(finite & (a == 0))
    vals[Stat.MIN] = torch.where(finite, x, inf).min().to(ROW_DTYPE)
    vals[Stat.MAX] = torch.where(finite, x, -inf).max().to(ROW_DTYPE)
    vals[Stat.ABSMAX] = torch.where(finite, a, -inf).max().to(ROW_DTYPE)
    vals[Stat.ABSMIN_NZ] = torch.where(nonzero, a, inf).min().to(ROW_DTYPE)
    x64 = xf.to(torch.float64)
    vals[Stat.SUM] = x64.sum()
    vals[Stat.SUMSQ] = (x64 * x64).sum()
    for fmt in ROW_FORMATS:
        f = FORMATS[fmt]
        base = FMT_BASE[fmt]
        half_sub = f.underflow_threshold
        vals[base + 0] = count(finite & (y > f.max))
        vals[base + 1] = count(nonzero & (y <= half_sub))
        vals[base + 2] = count(finite & (y > half_sub) & (y < f.subnormal_limit))
    vals[Stat.BITS_LO], vals[Stat.BITS_HI] = _fingerprint(x)
    head = torch.stack(vals[: Stat.HIST])

    # floor(log2 |x|) exactly: frexp gives |x| = m * 2**e with m in [0.5, 1).
    _, e = torch.frexp(torch.where(nonzero, a, torch.ones_like(a)))
    b = (e.to(torch.int64) - 1 - HIST_EMIN).clamp_(0, HIST_BINS - 1)
    hist = torch.zeros(HIST_BINS, dtype=ROW_DTYPE, device=x.device)
    hist.scatter_add_(0, b, nonzero.to(ROW_DTYPE))
    return torch.cat([head, hist])


def _fingerprint(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of the low and high 16 bits of each value's bit pattern (float32; float64 folded to
    32 bits), NaN canonicalised. Integer sums: exact and independent of summation order, so
    replicas holding the same tensor agree bit for bit and one flipped bit shows."""
    if x.dtype == torch.float64:
        b64 = x.view(torch.int64)
        bits = (b64 ^ (b64 >> 32)) & 0xFFFFFFFF
    else:
        bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(x.isnan(), 0x7FC00000, bits)
    lo = (bits & 0xFFFF).sum().to(ROW_DTYPE)
    hi = ((bits >> 16) & 0xFFFF).sum().to(ROW_DTYPE)
    return lo, hi
