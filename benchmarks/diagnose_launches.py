"""GPU time of each statistics launch of one sampled step, by kind of tensor, against the time
its bytes take at the read-once floor (GPU; a CPU smoke size runs the same code):

    python benchmarks/diagnose_launches.py [--config default|full] [--isolated]

Every launch of the step (launch_row_stats, and the taps' kept multi-tensor launches) is timed
by the profiler (its kernels' own GPU time); launches of the same kind (path, dtype, size) are
grouped. The floor is the bytes over the read bandwidth of a 1 GiB float32 torch.sum measured in
the same run.
--isolated also times each single-tensor kind alone (do_bench, L2 flushed, as bench_stats).
Where the step's statistics time goes: fixed cost per launch (many mid-size tensors) or
throughput (a few large ones).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.kernels import stats_multi, stats_triton, tile_multi  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_overhead import build, full_coverage, shapes, train_step  # noqa: E402
from bench_stats import kernel_fn, make, read_bandwidth, timer  # noqa: E402


class Marks:
    """Each launch inside a profiler range of its own, timed on the GPU from its first kernel's
    start to its last kernel's end (not from the host's call: a host that falls behind the GPU
    would add its own time); on the CPU, where the interpreter runs a launch to its end, by the
    range's host time."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.on = False
        self.meta: list = []

    def timed(self, kind: str, dtype, nbytes: int, count: int, fn):
        if not self.on:
            return fn()
        self.meta.append((kind, dtype, nbytes, count))
        with torch.profiler.record_function(f"sw_launch#{len(self.meta) - 1}"):
            return fn()

    def spans(self, prof) -> list:
        out = []
        for e in _ranges(prof, self.cuda):
            if e.name.startswith("sw_launch#"):
                out.append(self.meta[int(e.name.split("#")[1])] + (e.time_range.elapsed_us(),))
        return out


def _ranges(prof, cuda: bool) -> list:
    # With CUDA on, each record_function range appears twice: on the host, and mirrored on the
    # GPU's timeline from its first kernel's start to its last kernel's end (what is wanted
    # here: a host range's own device time leaves out kernels launched by other threads, such
    # as autograd's backward).
    from torch.autograd import DeviceType
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    return [e for e in prof.events() if e.device_type == want]


def instrument(marks: Marks):
    """Wrap the launch paths (before the monitor exists: the taps keep their launches).
    Returns the function that puts them back."""
    row = stats_triton.launch_row_stats
    saved = [(stats_triton, "launch_row_stats", row)]

    def launch_row_stats(flat, out_row, scale=1.0, tuning=None):
        return marks.timed("one tensor", flat.dtype, flat.numel() * flat.element_size(), 1,
                           lambda: row(flat, out_row, scale, tuning))
    stats_triton.launch_row_stats = launch_row_stats
    for cls, kind in ((stats_multi.ManyLaunch, "many small"),
                      (tile_multi.TileManyLaunch, "many, full tiles")):
        init, run = cls.__init__, cls.run
        saved += [(cls, "__init__", init), (cls, "run", run)]

        def __init__(self, flats, slots, device, *more, _init=init):
            _init(self, flats, slots, device, *more)
            # the tile launch reads the full tiles only; the tails go with the small tensors
            self._sizes = (flats[0].dtype, sum(f.numel() * f.element_size() for f in flats),
                           len(flats))

        def run_(self, rows, _run=run, _kind=kind):
            dtype, nbytes, count = self._sizes
            return marks.timed(_kind, dtype, nbytes, count, lambda: _run(self, rows))
        cls.__init__, cls.run = __init__, run_

    def undo():
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    return undo


def _name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
            torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype))


def table(spans: list, bw: float, t=None) -> list[str]:
    groups = collections.defaultdict(list)
    for kind, dtype, nbytes, count, us in spans:
        groups[(kind, dtype, nbytes, count)].append(us)
    head = "| path | dtype | tensors | MiB | launches | us each (median) | floor us | ratio |"
    rows = [head + (" alone us |" if t else ""),
            "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if t else "")]
    tot = flo = 0.0
    for (kind, dtype, nbytes, count), us in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        us.sort()
        med = us[len(us) // 2]
        floor = nbytes / bw
        tot += sum(us)
        flo += floor * len(us)
        line = (f"| {kind} | {_name(dtype)} | {count} | {nbytes / 2**20:.3g} | {len(us)} | "
                f"{med:.1f} | {floor:.1f} | {med / max(floor, 1e-9):.2f} |")
        if t:
            alone = "" if kind != "one tensor" else f"{t(kernel_fn(make(nbytes // dtype.itemsize, dtype, 'cuda'))):.1f}"
            line += f" {alone} |"
        rows.append(line)
    rows.append(f"\nall launches: {len(spans)}, {tot / 1e3:.2f} ms; their bytes at the floor "
                f"{flo / 1e3:.2f} ms (ratio {tot / max(flo, 1e-9):.2f}); above the floor "
                f"{(tot - flo) / 1e3:.2f} ms")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=("default", "full"), default="default")
    p.add_argument("--isolated", action="store_true")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = "cuda" if cuda else "cpu"
    t = timer(device)
    bw = read_bandwidth(device, t)
    marks = Marks(cuda)
    undo = instrument(marks)
    try:
        spans = _step(a, cuda, device, marks)
    finally:
        undo()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# statistics launches of one sampled step, {a.config} config, on {name}; floor "
          f"{bw / 1e3:.3f} TB/s")
    print("\n".join(table(spans, bw, t if (a.isolated and cuda) else None)))
    return 0


def _step(a, cuda: bool, device: str, marks: Marks) -> list:
    s = shapes(not cuda)
    model, opt, batch = build(s, device)
    backend = "auto" if cuda else "triton"  # the interpreter on the CPU
    cfg = dataclasses.replace(sw.Config(sinks=("jsonl",)) if a.config == "default"
                              else full_coverage(snapshots=False), backend=backend)
    if not cuda:  # the interpreter is slow: a few tensors of one step
        cfg = dataclasses.replace(cfg, roles=(sw.Role.OUTPUT, sw.Role.WEIGHT),
                                  module_types=(torch.nn.Linear,))
    with tempfile.TemporaryDirectory() as tmp:
        mon = sw.watch(model, opt, config=cfg, run_dir=tmp)
        sampled = 20 if cuda else 0  # sampled in both configs (every 10; every 1)
        for i in range(sampled):
            train_step(model, opt, batch, mon, i)
        if cuda:
            torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
        # the sampled step between two others, no sync between them (as in training)
        steps = range(sampled - 1, sampled + 2) if cuda else [sampled]
        with torch.profiler.profile(activities=acts) as prof:
            for i in steps:
                marks.on = i == sampled
                train_step(model, opt, batch, mon, i)
            marks.on = False
            if cuda:
                torch.cuda.synchronize()
        mon.close()
    return marks.spans(prof)


if __name__ == "__main__":
    sys.exit(main())
