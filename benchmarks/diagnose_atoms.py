"""GPU: how many elements per clock and SM the tile kernel's per-element pieces can take, with no
memory traffic (values made in registers), to tell which piece bounds the kernel:

    python benchmarks/diagnose_atoms.py

- count: one `red.shared.add` per element into the lane histogram (ptx._lane_hist_count);
- count+table: the same with the threshold table lookup (ptx._lane_thr_slot, _thr_value,
  _lane_hist_add_at: one ld.shared and one red.shared per element);
- alu: the same value arithmetic and a register sum instead of the count.
Elements per clock per SM use the SM clock nvidia-smi reports (or 1.98 GHz).
"""
from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl

from stabilitywatch.kernels.ptx import (_THR_SLOT_HI, _lane_col, _lane_hist_add_at,
                                        _lane_hist_count, _lane_hist_init_with, _lane_hist_read,
                                        _lane_thr_slot, _thr_value)
from stabilitywatch.kernels.tile_fast import _INIT_THR


@triton.jit
def _probe(out_ptr, iters, MODE: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)
    table = _lane_hist_init_with(pid * 0, _INIT_THR)
    col = _lane_col(pid * 0)
    tl.debug_barrier()
    k = tl.arange(0, N)
    x = (k * 40503 + pid * 977).to(tl.uint32)
    acc = tl.zeros([N], dtype=tl.uint32)
    for i in range(iters):
        x = x * 1664525 + 1013904223  # a new value per element and iteration
        u = ((x >> 9) & 0x7FFFFF) | (((x >> 3) & 31) + 100) << 23  # fields 100..131
        if MODE == 0:
            _lane_hist_count(u.to(tl.int32), table)
        elif MODE == 1:
            addr, t = _lane_thr_slot(u.to(tl.int32), col, _THR_SLOT_HI)
            _lane_hist_add_at(addr, _thr_value(u.to(tl.float32, bitcast=True), t))
        else:
            acc += u
    tl.debug_barrier()
    h = _lane_hist_read(tl.arange(0, 256))
    tl.store(out_ptr + pid, tl.sum(h, 0) + tl.sum(acc, 0).to(tl.int32))


def clock_ghz() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0]) / 1e3
    except Exception:
        return 1.98


def main() -> int:
    if not torch.cuda.is_available():
        print("diagnose_atoms: needs a GPU")
        return 0
    import triton.testing as tt
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ghz = clock_ghz()
    iters, n = 256, 2048
    out = torch.zeros(sms * 64, dtype=torch.int32, device="cuda")
    rows = ["| mode | warps | programs/SM | elements | us | elements/clock/SM |", "|---|---:|---:|---:|---:|---:|"]
    for mode, name in ((0, "count"), (1, "count+table"), (2, "alu")):
        for warps in (4, 8):
            for per_sm in (2, 4, 6):
                progs = sms * per_sm
                fn = lambda: _probe[(progs,)](out, iters, MODE=mode, N=n, num_warps=warps)  # noqa: E731
                us = tt.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3
                elems = progs * iters * n
                rows.append(f"| {name} | {warps} | {per_sm} | {elems} | {us:.1f} | "
                            f"{elems / (us * 1e3 * ghz) / sms:.2f} |")
    print(f"# diagnose_atoms: {torch.cuda.get_device_name()}, {sms} SMs, {ghz:.2f} GHz")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
