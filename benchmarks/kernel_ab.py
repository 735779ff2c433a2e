"""The statistics kernels of this tree against those of another git revision, in one run:
kernel times (GPU) and the compiled kernels' SASS (instruction counts by opcode, registers,
spills, shared memory, barriers).

    python benchmarks/kernel_ab.py --ref main                 # GPU: times and SASS
    python benchmarks/kernel_ab.py --ref main --compile-only  # no GPU: SASS for sm_90a
    python benchmarks/kernel_ab.py --ref-dir DIR ...          # DIR/stabilitywatch: the other

The revision's `stabilitywatch/` is unpacked (`git archive`) into a temporary directory as the
package `sw_ref` (its top-level __init__ left empty, so that only the kernels and what they
import load) and imported beside this tree's package. GPU: each case (dtype, size, scale, data)
runs both builds' `launch_row_stats` alternately, `--rounds` times, with do_bench (L2 flushed;
median us), checks that the rows agree (every field bit for bit but the float64 sums, whose
atomic order varies), then disassembles every kernel each build compiled for that case
(`cuobjdump -sass` of Triton's cubin). --compile-only compiles the same kernels for sm_90a with
Triton's bundled ptxas, from each build's own launch API. SASS is compared with symbol names
stripped: "same SASS" means the same instruction sequence.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unpack(rev: str, ref_dir: "str | None" = None) -> str:
    """The package of revision `rev` (or the `stabilitywatch/` folder inside ref_dir) as
    `sw_ref` in a new temporary directory (on sys.path)."""
    tmp = tempfile.mkdtemp(prefix="kernel_ab_")
    if ref_dir:
        shutil.copytree(os.path.join(ref_dir, "stabilitywatch"), os.path.join(tmp, "sw_ref"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", REPO, "archive", rev, "stabilitywatch"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        os.rename(os.path.join(tmp, "stabilitywatch"), os.path.join(tmp, "sw_ref"))
    with open(os.path.join(tmp, "sw_ref", "__init__.py"), "w") as f:
        f.write('"""stabilitywatch at another revision (benchmarks/kernel_ab.py)."""\n')
    sys.path.insert(0, tmp)
    return tmp


# -- SASS ---------------------------------------------------------------------------------------

_BIN = None


def _tool(name: str) -> str:
    global _BIN
    if _BIN is None:
        import triton
        _BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for n in ((name + "-blackwell", name) if name == "ptxas" else (name,)):
        p = os.path.join(_BIN, n)
        if os.path.exists(p):
            return p
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"no {name} next to Triton or on PATH")
    return found


_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_of_cubin(cubin: bytes) -> list[str]:
    """The instructions (opcode and operands, no addresses or symbol names) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    out = []
    for m in _INSN.finditer(text):
        ops = re.sub(r"\b\w*(kernel|_tiles|_row|_stats)\w*\b", "SYM", m.group(3))
        out.append(f"{(m.group(1) or '').strip()} {m.group(2)}{ops}".strip())
    return out


def summary(insns: list[str], regs: int, spills: int, shared: int) -> dict:
    ops = collections.Counter(next(t for t in i.split() if not t.startswith("@"))
                              for i in insns)
    return {"insns": len(insns), "regs": regs, "spills": spills, "shared": shared,
            "bar": sum(v for k, v in ops.items() if k.startswith("BAR")),
            "atom": sum(v for k, v in ops.items() if k.startswith(("ATOM", "RED"))),
            "ops": ops, "text": insns}


def compiled_summary(ck) -> dict:
    """summary() of a Triton CompiledKernel."""
    md = ck.metadata
    return summary(sass_of_cubin(ck.asm["cubin"]), _regs(ck), getattr(ck, "n_spills", 0) or 0,
                   md.shared)


def _regs(ck) -> int:
    n = getattr(ck, "n_regs", None)
    if n is not None and n >= 0:
        return n
    m = re.search(r"\.maxnreg (\d+)", ck.asm.get("ptx", ""))
    return int(m.group(1)) if m else -1


def compile_for_sm90(fn, signature: dict, constexprs: dict, options: dict) -> dict:
    """Compile a @triton.jit kernel for sm_90a without a GPU; its SASS summary."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(fn.arg_names)
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
    ptrs = [i for i, n in enumerate(names) if sig[n].startswith("*")]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in ptrs})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": options.get("num_warps", 4),
                                 **({"maxnreg": options["maxnreg"]}
                                    if options.get("maxnreg") else {})})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        cubin = os.path.join(d, "k.cubin")
        err = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True).stderr
        with open(cubin, "rb") as f:
            code = f.read()
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    smem = re.search(r"(\d+) bytes smem", err)
    return summary(sass_of_cubin(code), int(regs.group(1)) if regs else -1,
                   int(spill.group(1)) if spill else 0,
                   ck.metadata.shared + (int(smem.group(1)) if smem else 0))


# -- the kernels each build compiles, from its own launch API ----------------------------------

PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*i16", "e4m3": "*u8", "e5m2": "*u8"}
ITEM = {"fp32": 4, "fp16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}
ENC = {"fp32": 0, "fp16": 0, "e4m3": 1, "e5m2": 2, "bf16": 3}  # both builds' codes


def tile_cases() -> list[tuple]:
    """(label, dtype, scaled, has_ptr, pass) for the tile kernel: every pass a GPU takes."""
    out = []
    for dt in ITEM:
        fp8 = dt in ("e4m3", "e5m2")
        out.append((f"tile {dt} {'fp8 bytes' if fp8 else 'fast'}", dt, False, False,
                    "bytes" if fp8 else "fast"))
        if fp8:
            out.append((f"tile {dt} fast (value pass)", dt, False, False, "fast"))
        out.append((f"tile {dt} careful only", dt, False, False, "careful"))
        out.append((f"tile {dt} scaled (float)", dt, True, False, "scaled"))
        out.append((f"tile {dt} scaled (tensor)", dt, True, True, "scaled"))
    out.append(("tile bf16 fast, int64 offsets", "bf16", False, False, "wide"))
    return out


def _old_tile(pkg, dt, scaled, has_ptr, kind):
    st = sys.modules[pkg + ".kernels.stats_tile"]
    tr = sys.modules[pkg + ".kernels.stats_triton"]
    fp8 = ENC[dt]
    shape = st.tile_shape(ITEM[dt], False, 4)
    fast = 0 if kind == "careful" else 2
    bytes_ = kind in ("bytes", "scaled") and fp8 in (1, 2)
    consts, opts = st.tile_consts(True, has_ptr, scaled, fp8, shape, False, 3, True, fast, True,
                                  bytes_, tr.register_cap(fp8 == 3), 3,
                                  tr.PREFETCH_AHEAD[bool(bytes_) or fp8 == 3], kind == "wide")
    return st._tile_stats_kernel, consts, opts


def _new_tile(pkg, dt, scaled, has_ptr, kind):
    st = sys.modules[pkg + ".kernels.stats_tile"]
    tu = sys.modules[pkg + ".kernels.tuning"]
    c = sys.modules[pkg + ".kernels.constants"]
    enc = c.Encoding(ENC[dt])
    tuning = tu.Tuning(fast=c.FastPass.OFF if kind == "careful" else None,
                       fp8_bytes=kind in ("bytes", "scaled") and enc.is_fp8,
                       wide=kind == "wide")
    shape = tu.tile_shape(ITEM[dt], False, 4)
    plan = tu.tile_plan(tuning, enc, shape, n_full=1 << 26, programs=528, has_ptr=has_ptr,
                        scaled=scaled, aligned4=True, cuda=True, l2_prefetch=True)
    return st._tile_stats_kernel, plan.constexprs, plan.options


def tile_kernel(pkg, case):
    _, dt, scaled, has_ptr, kind = case
    new = (pkg + ".kernels.tuning") in sys.modules
    fn, consts, opts = (_new_tile if new else _old_tile)(pkg, dt, scaled, has_ptr, kind)
    sig = {"x_ptr": PTR[dt], "out_ptr": "*fp64", "scale_ptr": "*fp64", "scale_val": "fp32",
           "n_full": "i64" if consts.get("WIDE") else "i32"}
    return fn, sig, consts, {"num_warps": 4, **opts}


def general_kernels(pkg) -> list[tuple]:
    tr = sys.modules[pkg + ".kernels.stats_triton"]
    fn = tr._row_stats_kernel
    enc_name = "ENC" if "ENC" in fn.arg_names else "FP8"
    out = []
    for dt in ITEM:
        for has_ptr in (False, True):
            sig = {"x_ptr": PTR[dt], "k_ptr": PTR[dt], "out_ptr": "*fp64", "scale_ptr": "*fp64",
                   "scale_val": "fp32", "n": "i32"}
            out.append((f"general {dt}{' scale tensor' if has_ptr else ''}", fn, sig,
                        {enc_name: ENC[dt], "HAS_SCALE_PTR": has_ptr, "BLOCK": 1024},
                        {"num_warps": 4}))
    sm = sys.modules[pkg + ".kernels.stats_multi"]
    mfn = sm._multi_row_kernel
    for dt, elt in (("fp32", 0), ("fp16", 1), ("e4m3", 2), ("e5m2", 2), ("bf16", 3)):
        consts = ({"FP8": ENC[dt], "ELT": elt} if "ELT" in mfn.arg_names
                  else {"ENC": ENC[dt], "HALF": dt == "fp16"})
        consts["BLOCK"] = 1024
        out.append((f"many small {dt}", mfn, {"table_ptr": "*i64", "rows_ptr": "*fp64"},
                    consts, {"num_warps": 4}))
    tm = sys.modules[pkg + ".kernels.tile_multi"]
    tfn = tm._multi_tile_kernel
    for dt, elt in (("fp32", 0), ("fp16", 1), ("bf16", 3)):
        v = 16 // ITEM[dt]
        consts = ({"ELT": elt} if "ELT" in tfn.arg_names
                  else {"ENC": ENC[dt], "HALF": dt == "fp16"})
        consts.update(U=2, T=128, V=v, LANE=True, WORDS=dt == "bf16",
                      PREF=4 if dt == "bf16" else 2)
        out.append((f"many large {dt}", tfn, {"table_ptr": "*i64", "prog_ptr": "*i32",
                                              "rows_ptr": "*fp64"}, consts,
                    {"num_warps": 4, "maxnreg": 96 if dt == "bf16" else 128}))
    return out


def compile_only(pkgs: dict) -> int:
    rows = ["| kernel | build | SASS insns | registers | spills | shared | BAR | atomics | "
            "same SASS as ref |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    same_all = True

    def cases_of(pkg):
        out = [(c[0], *tile_kernel(pkg, c)) for c in tile_cases()]
        return out + general_kernels(pkg)

    by_build = {b: cases_of(p) for b, p in pkgs.items()}
    for i, (label, *_) in enumerate(by_build["ref"]):
        res = {}
        for b in pkgs:
            _, fn, sig, consts, opts = by_build[b][i]
            res[b] = compile_for_sm90(fn, sig, consts, opts)
        same = res["this"]["text"] == res["ref"]["text"]
        same_all &= same
        for b, r in res.items():
            rows.append(f"| {label} | {b} | {r['insns']} | {r['regs']} | {r['spills']} | "
                        f"{r['shared']} | {r['bar']} | {r['atom']} | "
                        f"{'yes' if same else 'NO'} |")
        print(rows[-2] + "\n" + rows[-1], flush=True)
    print("\n".join(rows))
    print(f"\nall kernels the same SASS: {same_all}")
    return 0 if same_all else 1


# -- GPU: times, rows, and the SASS of what each build compiled --------------------------------

def _launch_caches(pkg):
    st = sys.modules[pkg + ".kernels.stats_triton"]
    tl_ = sys.modules[pkg + ".kernels.stats_tile"]
    sm = sys.modules[pkg + ".kernels.stats_multi"]
    tm = sys.modules[pkg + ".kernels.tile_multi"]
    return [tl_._launch.cache, st._fast_general.cache, sm._launch.cache, tm._launch.cache]


def _gpt2_like(dtype, g, device, d=768, blocks=12, vocab=50257):
    """GPT-2 small's parameter shapes (12 blocks, d 768): the multi-tensor launches' case."""
    import torch
    shapes = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,), (d,),
              (d,), (d,), (d,)] * blocks + [(vocab, d), (1024, d)]
    return [torch.randn(s, device=device, generator=g).to(dtype) for s in shapes]


def _sass_of_new(pkgs, before, case, sass_rows):
    sass = {}
    for b, p in pkgs.items():
        found = []
        for cache, old in zip(_launch_caches(p), before[b]):
            found += [cache[k] for k in cache if k not in old]
        sass[b] = [compiled_summary(k) for k in found]
        for k, s in zip(found, sass[b]):
            sass_rows.append(f"| {case} | {b} | {k.name} | {s['insns']} | {s['regs']} | "
                             f"{s['spills']} | {s['shared']} | {s['bar']} |")
    if not (sass["ref"] or sass["this"]):
        return None
    return [s["text"] for s in sass["ref"]] == [s["text"] for s in sass["this"]]


def gpu_ab(pkgs: dict, a) -> int:
    import torch
    dev = "cpu" if a.smoke else "cuda"
    if a.smoke:  # the interpreter: the harness itself, at tiny sizes (no SASS: no GPU)
        import time

        class tt:
            @staticmethod
            def do_bench(fn, **_):
                t0 = time.perf_counter()
                fn()
                return (time.perf_counter() - t0) * 1e3
    else:
        import triton.testing as tt
    mods = {b: __import__(p + ".kernels.stats_triton", fromlist=["x"]) for b, p in pkgs.items()}
    layout = {b: __import__(p + ".stats.layout", fromlist=["x"]) for b, p in pkgs.items()}
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    want = [d for d in a.dtypes.split(";") if d]
    sizes = [float(m) for m in a.mib.split(";") if m]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = ["| case | MiB | ref us | this us | this / ref | rows agree | same SASS |",
            "|---|---:|---:|---:|---:|---|---|"]
    sass_rows = ["| case | build | kernel | SASS insns | registers | spills | shared | BAR |",
                 "|---|---|---|---:|---:|---:|---:|---:|"]
    ok = True
    for name in want:
        dt = dtypes[name]
        for mib in sizes:
            n = int(mib * 2**20) // dt.itemsize
            for data in a.data.split(";"):
                x = torch.randn(n, device=dev, generator=g) * torch.exp(
                    torch.randn(n, device=dev, generator=g))
                if data == "nonfinite":
                    x[n // 3] = float("nan")
                    x[n // 2] = float("inf")
                x = x.to(dt)
                for scale in (1.0, 0.37) if a.scaled else (1.0,):
                    case = f"{name} {data}{'' if scale == 1.0 else ' scaled'}"
                    before = {b: [set(c) for c in _launch_caches(p)] for b, p in pkgs.items()}
                    out = {}
                    for b in pkgs:
                        r = layout[b].init_row_tensor(dev)
                        mods[b].launch_row_stats(x, r, scale)
                        out[b] = r
                    _sync(dev)
                    agree = _rows_agree(out["ref"], out["this"], layout["this"].Stat)
                    times = {b: [] for b in pkgs}
                    for _ in range(a.rounds):
                        for b in pkgs:
                            r = layout[b].init_row_tensor(dev)
                            fn = (lambda m=mods[b], r=r: m.launch_row_stats(x, r, scale))
                            times[b].append(tt.do_bench(fn, warmup=10, rep=40,
                                                        return_mode="median") * 1e3)
                    med = {b: sorted(v)[len(v) // 2] for b, v in times.items()}
                    same = _sass_of_new(pkgs, before, f"{case} {mib:g} MiB", sass_rows)
                    ok &= agree and same is not False
                    rows.append(f"| {case} | {mib:g} | "
                                + " | ".join(", ".join(f"{t:.1f}" for t in times[b])
                                             for b in ("ref", "this"))
                                + f" | {med['this'] / med['ref']:.3f} | {agree} | "
                                f"{'-' if same is None else 'yes' if same else 'NO'} |")
                    print(rows[-1], flush=True)
    if a.many:
        for name in ("bf16", "fp32"):
            ts = _gpt2_like(dtypes[name], g, dev, *((64, 1, 4096) if a.smoke else ()))
            case = f"many: GPT-2 small's {len(ts)} parameters, {name}"
            before = {b: [set(c) for c in _launch_caches(p)] for b, p in pkgs.items()}
            out, runs = {}, {}
            for b, p in pkgs.items():
                disp = __import__(p + ".kernels.dispatch", fromlist=["x"])
                rows_ = layout[b].init_row_tensor(dev, len(ts))
                launches = disp.accumulate_many(ts, rows_, list(range(len(ts))))
                out[b] = rows_
                # the kept launches again (as the buffer repeats them), into the same rows
                runs[b] = lambda ls=launches, r=rows_: [lw.run(r) for lw, _ in ls]
            _sync(dev)
            agree = all(_rows_agree(out["ref"][i], out["this"][i], layout["this"].Stat)
                        for i in range(len(ts)))
            times = {b: [] for b in pkgs}
            for _ in range(a.rounds):
                for b in pkgs:
                    times[b].append(tt.do_bench(runs[b], warmup=10, rep=40,
                                                return_mode="median") * 1e3)
            med = {b: sorted(v)[len(v) // 2] for b, v in times.items()}
            same = _sass_of_new(pkgs, before, case, sass_rows)
            ok &= agree and same is not False
            mib = sum(t.numel() * t.element_size() for t in ts) / 2**20
            rows.append(f"| {case} | {mib:.1f} | "
                        + " | ".join(", ".join(f"{t:.1f}" for t in times[b])
                                     for b in ("ref", "this"))
                        + f" | {med['this'] / med['ref']:.3f} | {agree} | "
                        f"{'-' if same is None else 'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"\n# kernels on {card}, ref = {a.ref}\n")
    print("\n".join(sass_rows))
    print()
    print("\n".join(rows))
    return 0 if ok else 1


def _sync(dev: str) -> None:
    import torch
    if dev == "cuda":
        torch.cuda.synchronize()


def _rows_agree(a, b, Stat) -> bool:
    import torch
    sums = [int(Stat.SUM), int(Stat.SUMSQ), int(Stat.SHIFT_SUMSQ), int(Stat.SHIFT_SUM)]
    keep = torch.ones_like(a, dtype=torch.bool)
    keep[sums] = False
    scale = (float(a[Stat.NUMEL]) * float(a[Stat.SUMSQ].abs())) ** 0.5 + float(
        a[Stat.NUMEL]) * abs(float(a[Stat.SHIFT]))
    close = bool(((a[sums] - b[sums]).abs() <= 1e-12 * (a[sums].abs() + scale)).all())
    return bool(torch.equal(a[keep], b[keep])) and close


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ref", default="main", help="git revision to compare against")
    p.add_argument("--ref-dir", default=None, help="instead of --ref: a folder holding the "
                   "other build's stabilitywatch/ (where the tree has no .git)")
    p.add_argument("--compile-only", action="store_true", help="SASS for sm_90a, no GPU")
    p.add_argument("--dtypes", default="bf16;fp32;fp16;e4m3;e5m2")
    p.add_argument("--mib", default="2;24;96;512", help="tensor sizes, ;-separated")
    p.add_argument("--data", default="randn;nonfinite", help="randn (the fast pass) and "
                   "nonfinite (a NaN and an Inf: the careful pass)")
    p.add_argument("--scaled", action="store_true", help="also a float scale (careful pass)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU, the interpreter, tiny sizes: "
                   "the harness, not a measurement")
    p.add_argument("--many", action="store_true", help="also the multi-tensor launches over "
                   "GPT-2 small's parameter shapes (dispatch.accumulate_many)")
    a = p.parse_args(argv)
    if a.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        a.mib, a.rounds, a.many = "0.0625", 1, True
        a.dtypes = a.dtypes if a.dtypes != p.get_default("dtypes") else "bf16;e4m3"
    sys.path.insert(0, REPO)
    tmp = unpack(a.ref, a.ref_dir)
    try:
        import sw_ref.kernels.stats_multi  # noqa: F401
        import sw_ref.kernels.tile_multi  # noqa: F401
        import stabilitywatch.kernels.stats_multi  # noqa: F401
        import stabilitywatch.kernels.tile_multi  # noqa: F401
        pkgs = {"ref": "sw_ref", "this": "stabilitywatch"}
        return compile_only(pkgs) if a.compile_only else gpu_ab(pkgs, a)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
