"""GPU: the large CUDA allocations made during one weights-only monitored step, with the Python
frames that made them.  python benchmarks/diagnose_alloc.py"""
from __future__ import annotations

import tempfile

import torch
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.demo import TinyGPT


def main() -> None:
    torch.manual_seed(0)
    model = TinyGPT(50304, 768, 12, 12, 1024).cuda()
    cfg = sw.Config(every=1, sinks=("jsonl",), module_types=(nn.Linear,), roles=(sw.Role.WEIGHT,))
    with tempfile.TemporaryDirectory() as tmp:
        mon = sw.watch(model, config=cfg, run_dir=tmp)
        with mon.step(0):
            pass
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        with mon.step(1):
            pass
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        mon.close()
    big = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["size"] > 2**20]
    print(f"{len(big)} allocations > 1 MiB in one weights-only step")
    for e in sorted(big, key=lambda e: -e["size"])[:8]:
        frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in e["frames"]
                  if "python" not in f["filename"] or "stabilitywatch" in f["filename"]][:8]
        print(f"{e['size'] / 2**20:.1f} MiB", " <- ".join(frames))


if __name__ == "__main__":
    main()
