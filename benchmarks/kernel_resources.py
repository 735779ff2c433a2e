"""Registers, spills and shared memory of the tile kernel compiled for sm_90a, on a machine
without a GPU (Triton compiles to PTX; the ptxas shipped with Triton assembles it):

    python benchmarks/kernel_resources.py

Cheaper than device time for layout and register work. The device's own ptxas can assign
registers differently (benchmarks/RESULTS.md, "Compiled kernel resources"): check occupancy on
the GPU before trusting a register count near a cap. compile_tile(..., sass=FILE) also writes
the SASS, to count a loop's instructions. Needs a Triton whose bundled ptxas accepts its PTX
(triton 3.9: ptxas-blackwell).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from stabilitywatch.kernels import stats_tile, tuning  # noqa: E402
from stabilitywatch.kernels.constants import Encoding, FastPass  # noqa: E402

PTR = {Encoding.FLOAT: "*fp32", Encoding.E4M3: "*u8", Encoding.E5M2: "*u8",
       Encoding.BF16: "*i16"}


def compile_tile(enc: Encoding, shape: tuple, warps: int, sass: "str | None" = None,
                 maxnreg=None, **consts) -> tuple[int, int, int]:
    k = stats_tile._tile_stats_kernel
    u, t, v = shape
    c = dict(ENC=int(enc), SCALED=False, HAS_SCALE_PTR=False, U=u, T=t, V=v, BALLOT=False,
             FAST=int(FastPass.LANE_HISTOGRAM), WORDS=False, BYTES=False, PREF=0, WIDE=False)
    c.update(consts)
    # Triton passes an n_full below 2^31 as int32: i64 only for the WIDE kernels
    sig = {"x_ptr": PTR[Encoding(enc)], "out_ptr": "*fp64", "scale_ptr": "*fp64",
           "scale_val": "fp32",
           "n_full": "i64" if c["WIDE"] else "i32", **{n: "constexpr" for n in c}}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(k.arg_names.index(n),): val for n, val in c.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})  # aligned pointers
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")
                 if os.path.exists(os.path.join(bindir, n)))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ck.asm["ptx"])
    cubin = f.name + ".cubin"
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", cubin],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    if sass and os.path.exists(cubin):  # the SASS, to count a loop's instructions
        with open(sass, "w") as g:
            g.write(subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin],
                                   capture_output=True, text=True).stdout)
    if os.path.exists(cubin):
        os.unlink(cubin)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    smem = re.search(r"(\d+) bytes smem", out)  # static (the lane histogram), not Triton's own
    if regs is None:
        raise RuntimeError(out[-800:])
    return (int(regs.group(1)), int(spill.group(1)) if spill else 0,
            ck.metadata.shared + (int(smem.group(1)) if smem else 0))


def main() -> int:
    # the kernels a large tensor gets on an sm_90 GPU: tuning.tile_plan's constexprs and
    # register cap (a 4-byte aligned tensor, a scale of 1 or a float scale, default tuning)
    print("| input | pass | tile (U, T, V) | warps | register cap | registers | spill bytes | "
          "shared |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, enc, item in (("bf16", Encoding.BF16, 2), ("fp32", Encoding.FLOAT, 4),
                            ("e4m3", Encoding.E4M3, 1)):
        shape = tuning.tile_shape(item, False, 4)
        for label, scaled, fast in (("fast", False, None), ("careful only", False, FastPass.OFF),
                                    ("scaled", True, None)):
            plan = tuning.tile_plan(tuning.Tuning(fast=fast), enc, shape, 1 << 26, 528, False,
                                    scaled, True, True, True)
            consts = plan.constexprs
            if consts["BYTES"]:
                label = "fp8 bytes" + (", scaled" if scaled else "")
            elif scaled:
                label = "scaled (careful)"
            cap = plan.options.get("maxnreg")
            r, s, sh = compile_tile(enc, shape, 4, maxnreg=cap, **consts)
            print(f"| {name} | {label} | {shape} | 4 | {cap or '-'} | {r} | {s} | {sh} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
