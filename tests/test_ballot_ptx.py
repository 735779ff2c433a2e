"""The warp-ballot histogram's PTX (ptx._BALLOT_PTX), run by a small emulator of the
instructions it uses over the 32 lanes of a warp, against a plain count. The GPU runs the real
thing in tests/test_kernel_gpu.py; this checks the text itself on any machine."""
import re

import numpy as np
import pytest

from stabilitywatch.kernels.ptx import _BALLOT_PTX

M32 = 0xFFFFFFFF


def run_warp(ptx: str, sel: list[int]) -> list[int]:
    """$1 = sel[lane] for each of 32 lanes; returns $0 of each lane."""
    lines = [ln.strip().rstrip(";") for ln in str(getattr(ptx, "value", ptx)).splitlines()]
    body = [ln for ln in lines if ln and not ln.startswith((".reg", "{", "}"))]
    regs = [{"$1": s & M32} for s in sel]

    def val(r, lane, tok):
        if tok in r:
            return r[tok]
        if tok == "%laneid":
            return lane
        return int(tok, 0) & M32

    for ins in body:
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op.startswith("vote.sync.ballot"):
            bal = sum(1 << lane for lane in range(32) if regs[lane][a[1]])
            for r in regs:
                r[a[0]] = bal
            continue
        for lane, r in enumerate(regs):
            v = [val(r, lane, t) for t in a[1:]]
            if op == "mov.u32":
                r[a[0]] = v[0]
            elif op == "setp.lt.u32":
                r[a[0]] = v[0] < v[1]
            elif op == "setp.ne.u32":
                r[a[0]] = v[0] != v[1]
            elif op == "and.b32":
                r[a[0]] = v[0] & v[1]
            elif op == "xor.b32":
                r[a[0]] = v[0] ^ v[1]
            elif op == "or.b32":
                r[a[0]] = v[0] | v[1]
            elif op == "not.b32":
                r[a[0]] = ~v[0] & M32
            elif op == "sub.u32":
                r[a[0]] = (v[0] - v[1]) & M32
            elif op == "shl.b32":
                r[a[0]] = (v[0] << v[1]) & M32
            elif op == "bfe.u32":
                r[a[0]] = (v[0] >> v[1]) & ((1 << v[2]) - 1)
            elif op == "popc.b32":
                r[a[0]] = bin(v[0]).count("1")
            else:
                raise AssertionError(f"emulator lacks {op}")
    return [r["$0"] for r in regs]


@pytest.mark.parametrize("seed", range(20))
def test_ballot_counts_bins_lane_and_lane_plus_32(seed):
    rng = np.random.default_rng(seed)
    # concentrated bins (as a tensor's exponents are), some out of range (not counted)
    sel = rng.choice([3, 4, 5, 37, 63, 0, 64, -5, 200], size=32).tolist()
    if seed % 4 == 0:
        sel = rng.integers(-3, 70, size=32).tolist()
    out = run_warp(_BALLOT_PTX, sel)
    for lane in range(32):
        assert out[lane] & 0xFFFF == sel.count(lane), (lane, sel)
        assert out[lane] >> 16 == sel.count(lane + 32), (lane, sel)


def test_emulator_runs_every_instruction():
    ops = {ln.split()[0] for ln in str(getattr(_BALLOT_PTX, "value", _BALLOT_PTX)).splitlines()
           if re.match(r"\s*[a-z]", ln) and not ln.strip().startswith(".reg")}
    assert ops <= {"mov.u32", "setp.lt.u32", "setp.ne.u32", "and.b32", "xor.b32", "or.b32",
                   "not.b32", "sub.u32", "shl.b32", "bfe.u32", "popc.b32",
                   "vote.sync.ballot.b32"}, ops
