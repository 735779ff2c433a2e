"""Where does the statistics kernel's time go? Stripped-down kernels on a 256 MiB tensor, each
keeping only per-lane work inside the loop (no block-wide reductions), with and without the
per-iteration exponent histogram. GPU only:

    python benchmarks/kernel_experiments.py
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
import triton.testing as tt

MAXI = tl.constexpr(0x7FFFFFFF)
INF = tl.constexpr(0x7F800000)


@triton.jit
def _lanes_only(x_ptr, out_ptr, n, BF16: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr,
                NTHR: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    zi = tl.zeros([BLOCK], dtype=tl.int32)
    c_nf, c_z, c0, c1, c2, c3, c4, c5, c6, c7, c8 = zi, zi, zi, zi, zi, zi, zi, zi, zi, zi, zi
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    amn = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
    s1 = tl.zeros([BLOCK], dtype=tl.float32)
    s2 = tl.zeros([BLOCK], dtype=tl.float32)
    hist = tl.zeros([128], dtype=tl.int32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + lanes
        if BF16:
            bits = tl.load(x_ptr + offs).to(tl.int32) << 16
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + offs)
            bits = x.to(tl.int32, bitcast=True)
        u = bits & MAXI
        fin = u < INF
        c_nf += (u >= INF).to(tl.int32)
        z = u == 0
        c_z += z.to(tl.int32)
        amn = tl.minimum(amn, tl.where(z | ~fin, MAXI, u))
        xf = tl.where(fin, x, 0.0)
        mn = tl.minimum(mn, xf)
        mx = tl.maximum(mx, xf)
        s1 += xf
        s2 += xf * xf
        if NTHR >= 3:
            c0 += (u > 0x43E00000).to(tl.int32)
            c1 += (u > 0x3A800000).to(tl.int32)
            c2 += (u > 0x3C6FFFFF).to(tl.int32)
        if NTHR >= 9:
            c3 += (u > 0x47600000).to(tl.int32)
            c4 += (u > 0x37000000).to(tl.int32)
            c5 += (u > 0x385FFFFF).to(tl.int32)
            c6 += (u > 0x477FE000).to(tl.int32)
            c7 += (u > 0x33000000).to(tl.int32)
            c8 += (u > 0x387FDFFF).to(tl.int32)
        if HIST:
            b = tl.minimum(tl.maximum((u >> 23) - 31, 0), 127)
            hist += tl.histogram(b, 128, mask=fin & ~z)
    tot = (tl.sum(c_nf, 0) + tl.sum(c_z, 0) + tl.sum(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8, 0)
           + tl.min(amn, 0))
    tl.atomic_add(out_ptr, tot.to(tl.float32) + tl.sum(s1 + s2, 0) + tl.min(mn, 0) + tl.max(mx, 0))
    tl.atomic_add(out_ptr + 1 + tl.arange(0, 128), hist.to(tl.float32))


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_experiments.py needs a GPU")
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(129, device="cuda")
    big = torch.randn(1 << 28, device="cuda")
    bw = 4 * big.numel() / tt.do_bench(lambda: big.sum(), return_mode="median")  # bytes/ms
    print(f"| kernel | dtype | us | floor us | ratio |\n|---|---|---:|---:|---:|")
    for dname, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.randn((256 << 20) // dt.itemsize, device="cuda").to(dt)
        xv = x.view(torch.int16) if dt == torch.bfloat16 else x
        floor = (256 << 20) / bw * 1e3
        for name, kw in (("lanes only, 0 thresholds", dict(HIST=False, NTHR=0)),
                         ("lanes only, 3 thresholds", dict(HIST=False, NTHR=3)),
                         ("lanes only, 9 thresholds", dict(HIST=False, NTHR=9)),
                         ("9 thresholds + hist128", dict(HIST=True, NTHR=9)),
                         ("0 thresholds + hist128", dict(HIST=True, NTHR=0))):
            for block, warps, per_sm in ((1024, 4, 8), (2048, 8, 4), (512, 4, 16)):
                grid = (min(triton.cdiv(x.numel(), block), sms * per_sm),)
                fn = lambda: _lanes_only[grid](xv, out, x.numel(), BF16=dt == torch.bfloat16,  # noqa
                                               BLOCK=block, num_warps=warps, **kw)
                us = tt.do_bench(fn, return_mode="median") * 1e3
                print(f"| {name} b{block} w{warps} p{per_sm} | {dname} | {us:.1f} | {floor:.1f} "
                      f"| {us / floor:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
