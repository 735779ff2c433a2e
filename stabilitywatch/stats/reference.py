"""Pure-torch statistics row: the CPU path, the fallback, and the test oracle of the kernels.

It does the same arithmetic as the Triton kernel (values upcast to float32, y = x * scale in
float32, float64 sums), so counts and min/max agree exactly and sums to rounding. float64 inputs
(no kernel reads them) stay float64 throughout: narrowing them would turn values beyond
float32's range into Inf or zero and round values next to a format's thresholds across them.
The scale follows stats/scale.py's rule. It never syncs with the host: no item()/tolist(), no
boolean-mask indexing, histogram by scatter_add.
"""
from __future__ import annotations

import torch

from ..formats import FORMATS, ROW_FORMATS
from .layout import HIST_BINS, HIST_EMIN, ROW_DTYPE, init_row_tensor
from .scale import effective_scale, effective_scale_tensor

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
    # resolve_neg: a view with the negative bit set (complex.conj().imag) holds the values
    # un-negated in memory; bit views of it are refused
    x = t.detach().resolve_neg().reshape(-1).to(work)
    if isinstance(scale, torch.Tensor):
        s = effective_scale_tensor(scale.to(x.device)).to(work)
    else:
        s = effective_scale(scale)
    inf = float("inf")

    nan = x.isnan()
    posinf = x == float("inf")
    neginf = x == float("-inf")
    finite = x.isfinite()
    a = x.abs()
    nonzero = finite & (a != 0)
    y = (x * s).abs()

    # every count in one reduction: masks stacked as columns (per-call overhead dominates small
    # tensors on the CPU, so fewer, wider calls)
    masks = [nan, posinf, neginf, finite & (a == 0)]
    for fmt in ROW_FORMATS:
        f = FORMATS[fmt]
        half_sub = f.underflow_threshold
        masks += [finite & (y > f.max), nonzero & (y <= half_sub),
                  finite & (y > half_sub) & (y < f.subnormal_limit)]
    counts = torch.stack(masks, 1).sum(0, dtype=torch.int64).to(ROW_DTYPE)

    xf = torch.where(finite, x, 0.0).to(torch.float64)
    # the shift: the first element (the kernels' too: flat_view starts at element [0, ..., 0]),
    # 0 when it is not finite; never -0.0 (the unset mark)
    k = x[0].to(torch.float64)
    k = torch.where(k.isfinite() & (k != 0), k, 0.0)
    dev = torch.where(finite, x.to(torch.float64) - k, 0.0)
    mn = torch.where(finite, x, inf).min()
    mx = torch.where(finite, x, -inf).max()
    extrema = torch.stack([mn, mx, torch.maximum(-mn, mx),  # absmax: -inf when nothing is finite
                           torch.where(nonzero, a, inf).min()]).to(ROW_DTYPE)
    head = torch.cat([
        torch.full((1,), float(x.numel()), dtype=ROW_DTYPE, device=x.device),  # NUMEL
        counts[:4],                                   # NAN, POSINF, NEGINF, ZEROS
        extrema,                                      # MIN, MAX, ABSMAX, ABSMIN_NZ
        torch.stack([xf.sum(), torch.dot(xf, xf)]),   # SUM, SUMSQ
        counts[4:],                                   # format counts
        _fingerprint(x),                              # BITS_LO, BITS_HI
        torch.stack([k, dev.sum(), torch.dot(dev, dev)]),  # SHIFT, SHIFT_SUM, SHIFT_SUMSQ
    ])

    # floor(log2 |x|) exactly: frexp gives |x| = m * 2**e with m in [0.5, 1).
    _, e = torch.frexp(torch.where(nonzero, a, torch.ones_like(a)))
    b = (e.to(torch.int64) - 1 - HIST_EMIN).clamp_(0, HIST_BINS - 1)
    hist = torch.zeros(HIST_BINS, dtype=ROW_DTYPE, device=x.device)
    hist.scatter_add_(0, b, nonzero.to(ROW_DTYPE))
    return torch.cat([head, hist])


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Sums of the low and high 16 bits of each value's bit pattern (float32; float64 folded to
    32 bits), NaN canonicalised. Integer sums: exact and independent of summation order, so
    replicas holding the same tensor agree bit for bit and one flipped bit shows."""
    if x.dtype == torch.float64:
        b64 = x.view(torch.int64)
        bits = (b64 ^ (b64 >> 32)) & 0xFFFFFFFF
    else:
        bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(x.isnan(), 0x7FC00000, bits)
    return torch.stack([(bits & 0xFFFF).sum(), ((bits >> 16) & 0xFFFF).sum()]).to(ROW_DTYPE)
