"""`sw.tensor_stats` on the CPU, this tree against another git revision, alternately in fresh
processes on the same machine: per dtype the fastest of 7 x 50 calls on 65,536 values.

    OMP_NUM_THREADS=1 python benchmarks/cpu_stats_ab.py --ref main [--rounds 2]

The revision's `stabilitywatch/` is unpacked with `git archive` into a temporary folder that
goes first on the child's sys.path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2"]

CHILD = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import stabilitywatch as sw
assert sw.__file__.startswith(sys.argv[1]), sw.__file__
torch.set_num_threads(1)
torch.manual_seed(0)
out = {}
for name in %r:
    x = (torch.randn(65536) * 3).to(getattr(torch, name))
    for _ in range(20):
        sw.tensor_stats(x)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(50):
            sw.tensor_stats(x)
        best = min(best, (time.perf_counter() - t) / 50 * 1e3)
    out[name] = best
print(json.dumps(out))
""" % (DTYPES,)


def measure(tree: str) -> dict:
    got = subprocess.run([sys.executable, "-c", CHILD, tree], capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", default="main", help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        arc = subprocess.run(["git", "-C", ROOT, "archive", a.ref, "stabilitywatch"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=arc, check=True)
        runs: dict = {"this tree": [], a.ref: []}
        for _ in range(a.rounds):
            runs[a.ref].append(measure(tmp))
            runs["this tree"].append(measure(ROOT))
    print(f"# tensor_stats of 65,536 values, ms (fastest of 7 x 50 calls), {a.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| dtype | " + " | ".join(runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for d in DTYPES:
        cells = [" / ".join(f"{r[d]:.3f}" for r in rs) for rs in runs.values()]
        print(f"| {d} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
