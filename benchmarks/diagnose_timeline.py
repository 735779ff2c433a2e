"""Where a monitored step loses time, from a profiler timeline (GPU):

    python benchmarks/diagnose_timeline.py [--configs "none;default;full"]
    python benchmarks/diagnose_timeline.py --window 12 [--configs ...]   # unsynced steps
    python benchmarks/diagnose_timeline.py --events 30 [--configs ...]   # no profiler

For each configuration, one sampled and one unsampled step (synced before each) run under
torch.profiler with Python stacks. Printed per step: wall time (step start to the last GPU
work), the host's time in the step, the main stream's busy time and its idle gaps, the
device-to-host copies, and the largest gaps with the Python functions the host was in when each
began: a gap on the main stream is time the GPU waited for the host (or for a copy).

--window N: N steps back to back with no sync between them (as in training, where the host runs
ahead of the GPU), profiled without Python stacks; per step, the main stream's busy time and
idle gaps, and the CPU operators the host was in when the largest gaps began.
"""
from __future__ import annotations


import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile

import torch

import stabilitywatch as sw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import build, full_coverage, shapes, train_step  # noqa: E402


def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _where(py, t):
    # the innermost few Python frames (ours or torch's) active on the host at time t
    live = [e for e in py if e["ts"] <= t <= e["ts"] + e["dur"]]
    live.sort(key=lambda e: e["dur"])
    names = []
    for e in live:
        n = e["name"].split("/")[-1]
        if "built-in" in n or n.startswith("<"):
            continue
        names.append(n[:60])
        if len(names) == 3:
            break
    return " < ".join(names) or "?"


def analyse(trace: str, label: str) -> None:
    ev = json.load(open(trace))["traceEvents"]
    mark = next(e for e in ev if e.get("name") == "sw_step" and e.get("cat") == "user_annotation")
    t0, host = mark["ts"], mark["dur"]
    kern = [e for e in ev if e.get("cat") == "kernel" and e["ts"] >= t0]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy" and e["ts"] >= t0]
    py = [e for e in ev if e.get("cat") == "python_function" and e.get("dur")]
    streams = {}
    for e in kern:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    main = max(streams.values(), key=len)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in main])
    end = max([b for _, b in busy] + [e["ts"] + e["dur"] for e in copies])
    gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)]
    first_gap = busy[0][0] - t0
    d2h = [e for e in copies if "DtoH" in e["name"] or "Device -> Pageable" in e["name"]
           or "Device -> Pinned" in e["name"]]
    d2h_u = _union([(e["ts"], e["ts"] + e["dur"]) for e in d2h])
    opt = next((e for e in main if "adam" in e["name"].lower()), None)
    busy_ms = sum(b - a for a, b in busy) / 1e3
    print(f"\n## {label}: wall {(end - t0) / 1e3:.1f} ms, host in step {host / 1e3:.1f} ms, main "
          f"stream busy {busy_ms:.1f} ms in {len(main)} kernels, idle {sum(g for g, _ in gaps) / 1e3:.1f} ms"
          f" (+{first_gap / 1e3:.1f} before the first kernel); other streams: "
          f"{ {k: len(v) for k, v in streams.items() if v is not main} }")
    if d2h_u:
        print(f"   device-to-host copies: {len(d2h)}, {sum(b - a for a, b in d2h_u) / 1e3:.1f} ms busy, "
              f"from +{(d2h_u[0][0] - t0) / 1e3:.1f} to +{(d2h_u[-1][1] - t0) / 1e3:.1f} ms")
    if opt is not None:
        print(f"   optimizer kernel starts at +{(opt['ts'] - t0) / 1e3:.1f} ms")
    print("   largest main-stream gaps (ms at +ms: host in):")
    for g, at in sorted(gaps, reverse=True)[:8]:
        print(f"     {g / 1e3:6.2f} at +{(at - t0) / 1e3:6.1f}: {_where(py, at)}")


def analyse_window(trace: str, label: str) -> None:
    ev = json.load(open(trace))["traceEvents"]
    marks = sorted((e for e in ev if e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("sw_step ")), key=lambda e: e["ts"])
    gpu_marks = sorted((e for e in ev if e.get("cat") == "gpu_user_annotation"
                        and e.get("name", "").startswith("sw_step ")), key=lambda e: e["ts"])
    kern = [e for e in ev if e.get("cat") == "kernel"]
    streams = {}
    for e in kern:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    main = max(streams.values(), key=len)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in main])
    ops = [e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime") and e.get("dur")]
    copies = _union([(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "gpu_memcpy"])
    print(f"\n## {label}: {len(marks)} steps; main stream busy / idle per step (ms), copies (ms)")
    starts = [m["ts"] for m in gpu_marks] or [m["ts"] for m in marks]
    for k, m in enumerate(marks):
        lo = starts[k] if k < len(starts) else m["ts"]
        hi = starts[k + 1] if k + 1 < len(starts) else max(b for _, b in busy)
        inb = sum(max(0, min(b, hi) - max(a, lo)) for a, b in busy)
        cp = sum(max(0, min(b, hi) - max(a, lo)) for a, b in copies)
        gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)
                if lo <= busy[i][1] < hi]
        big = sorted(gaps, reverse=True)[:3]
        where = "; ".join(
            f"{g / 1e3:.2f} at +{(at - lo) / 1e3:.1f}: "
            + (min((o for o in ops if o["ts"] <= at <= o["ts"] + o["dur"]),
                   key=lambda o: o["dur"], default={"name": "?"})["name"][:40])
            for g, at in big if g > 200)
        print(f"  {m['name']}: GPU step {(hi - lo) / 1e3:.1f}, busy {inb / 1e3:.1f}, idle "
              f"{(hi - lo - inb) / 1e3:.1f}, copies {cp / 1e3:.1f}, host {m['dur'] / 1e3:.1f}"
              f"  | {where}")


CONFIGS = {"none": lambda: None, "default": lambda: sw.Config(sinks=("jsonl",)),
           "default-nosinks": lambda: sw.Config(sinks=()),
           "default-nocapture": lambda: sw.Config(sinks=("jsonl",), capture=()),
           "full": full_coverage, "full-nosnap": lambda: full_coverage(False),
           "full-devsnap": lambda: full_coverage().replace(
                                                       capture={"snapshot_to": "device"})}


@contextlib.contextmanager
def monitored(cname: str, wrap=None):
    """(config, step(i)) for one configuration of the benchmark model, warmed up over steps
    0-14; wrap(i) gives a context around each step (a profiler mark)."""
    s = shapes(False)
    model, opt, batch = build(s, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CONFIGS[cname]()
        mon = sw.watch(model, opt, config=cfg, run_dir=tmp) if cfg else None

        def step(i):
            with (wrap(i) if wrap else contextlib.nullcontext()):
                train_step(model, opt, batch, mon, i)

        for i in range(15):
            step(i)
        torch.cuda.synchronize()
        try:
            yield cfg, step, tmp
        finally:
            if mon:
                mon.close()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="none;default;full")
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--events", type=int, default=0)
    a = p.parse_args()
    if a.events:
        return events(a)
    if a.window:
        return window(a)
    from torch.profiler import ProfilerActivity, profile, record_function
    for cname in a.configs.split(";"):
        with monitored(cname) as (cfg, step, tmp):
            for i in (20, 21):
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             with_stack=True) as prof:
                    with record_function("sw_step"):
                        step(i)
                    torch.cuda.synchronize()
                path = f"{tmp}/trace{i}.json"
                prof.export_chrome_trace(path)
                try:
                    analyse(path, f"{cname} config, step {i}"
                            + (" (sampled)" if cfg and (cfg.every == 1 or i % cfg.every == 0)
                               else ""))
                except Exception as e:  # keep the trace for a look elsewhere
                    print(f"analysis failed: {type(e).__name__}: {e}")
                    if os.environ.get("OUT"):
                        import gzip
                        import shutil
                        with open(path, "rb") as f, gzip.open(
                                f"{os.environ['OUT']}/trace_{cname}_{i}.json.gz", "wb") as g:
                            shutil.copyfileobj(f, g)


def events(a) -> None:
    """GPU time per step from CUDA events recorded at each step start, steps back to back with
    no sync and no profiler: a step longer on the GPU than its kernels is one the GPU spent
    waiting (for the host, or for a copy)."""
    import time
    n = a.events
    for cname in a.configs.split(";"):
        evs, host = [], []

        def mark(i):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            evs.append(e)
            host.append(time.perf_counter())
            return contextlib.nullcontext()

        with monitored(cname, wrap=mark) as (_, step, _tmp):
            evs.clear()
            host.clear()
            for i in range(15, 16 + n):
                step(i)
            torch.cuda.synchronize()
        gpu = [evs[k].elapsed_time(evs[k + 1]) for k in range(n)]
        hst = [(host[k + 1] - host[k]) * 1e3 for k in range(n)]
        print(f"\n## {cname}: GPU ms per step (step start to next step start), steps "
              f"15..{14 + n}; total {sum(gpu):.1f} ms")
        print("  GPU : " + " ".join(f"{g:5.1f}" for g in gpu))
        print("  host: " + " ".join(f"{h:5.1f}" for h in hst))


def window(a) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function
    for cname in a.configs.split(";"):
        with monitored(cname, wrap=lambda i: record_function(f"sw_step {i}")) as (_, step, tmp):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(18, 18 + a.window):
                    step(i)
                torch.cuda.synchronize()
            path = f"{tmp}/window.json"
            prof.export_chrome_trace(path)
            analyse_window(path, f"{cname} config")


if __name__ == "__main__":
    main()
