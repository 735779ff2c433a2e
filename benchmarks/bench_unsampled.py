"""The training thread's CPU time per step spent in the monitor, by part, on unsampled and
sampled steps of the default config:

    python benchmarks/bench_unsampled.py [--device cpu|cuda] [--model llama|gpt2]
        [--steps 45] [--skip 15] [--repeats 2] [--config default] [--keep-hooks] [--sync]
        [--smoke] [--layers N]

Models: benchmarks/bench_steps.py's `build` (HF Llama, 8 layers, d 1024, batch 8 x 1024, bf16
autocast, fused AdamW on CUDA; `--smoke` or the CPU: its tiny shapes, 2 layers of d 64).
`--layers N` gives the tiny models and the full-size Llama N layers: `--device cpu --layers 8`
has the GPU Llama's 75 watched modules and parameter gradients at the tiny shapes. One run without a
monitor and one with `--config` (default: `Config()`; "default,nosentinel" etc. as in
bench_steps.py), with `--keep-hooks` also that config with its forward hooks registered on every
step (as on a torch.compile'd model), their steps interleaved, `--repeats` times (medians over
repeats). Parts, `time.thread_time` of the training
thread, mean per step over steps `--skip`.. (a step is sampled when the schedule reads more
than the loss):

- begin / end: `Monitor._begin` / `Monitor._end` (the step start: schedule, RNG states for
  captures, ...; the step end: the copies to host memory, reading landed frames, queueing them);
- observe_loss: `Monitor.observe_loss`;
- optimizer taps: the monitor's optimizer pre- and post-step hooks (the sentinel's launch, the
  guard, update and optimizer-state taps, the snapshot's wait), timed by hooks of this script
  registered before and after the monitor's;
- forward / backward: the user's forward (backward) call minus the unmonitored run's mean (the
  module and gradient hooks; noisy: the difference of two means);
- hooks: forward hooks on the watched modules during the step (the early-returning ones cost
  the module call's slow path even when they do nothing).

On CUDA the backward runs on the autograd engine's own thread (the training thread waits in
`backward()`): its CPU time, gradient hooks included, is the "backward thread CPU" column, not
in the training thread's. Also per step: the pinned host allocations made
(`torch.cuda.host_memory_stats` "num_host_alloc": cudaHostAlloc blocks the host), the time
step starts waited for the frame processing thread, and, with `--sync` (a synchronize around each step, as a profiler would),
the wall time: wall growing beyond CPU time is a wait. The monitor's other threads hold the
GIL too: while they run Python, each GIL re-acquisition of the training thread (after every
torch call, which releases it) can wait for them. Their columns, last: the frame processing
thread's CPU time during the step; its CPU time inside the monitor's `_handle` for the frame
of this step (processed a step or two later); that thread's CPU time from this step's start to
the next step's start of the same run (the other runs' interleaved steps included: a frame is
processed after its step's end); and the monitor's sink threads' CPU time over that span.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_steps  # noqa: E402

PARTS = ("begin", "forward", "backward", "observe_loss", "optimizer taps", "end")


def _pinned_allocs(device: str) -> int:
    if device != "cuda":
        return 0
    try:
        return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
    except (AttributeError, RuntimeError):
        return 0


def _cpu_of(ident) -> float:
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError, ProcessLookupError):
        return 0.0


def _processing_cpu(mon) -> float:
    """CPU time of the monitor's frame processing thread (0 without one)."""
    thread = mon.processor._thread if mon is not None else None
    return _cpu_of(thread.ident) if thread is not None else 0.0


def _sinks_cpu(mon) -> float:
    """CPU time of the monitor's sink threads."""
    return sum(_cpu_of(w.thread.ident) for w in mon.sinks._workers) if mon is not None else 0.0


class _FrameTimed:
    """The processing thread's CPU time in the monitor's `_handle`, per frame (by step)."""

    def __init__(self, fn):
        self.fn, self.cpu = fn, {}

    def __call__(self, frame):
        t = time.thread_time()
        try:
            return self.fn(frame)
        finally:
            self.cpu[frame.step] = self.cpu.get(frame.step, 0.0) + time.thread_time() - t


class _Timed:
    """Sums the training thread's CPU time spent in a callable (per step: `take()`)."""

    def __init__(self, fn):
        self.fn, self.spent = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.spent += time.thread_time() - t

    def take(self) -> float:
        out, self.spent = self.spent, 0.0
        return out


class _Run:
    """One model and optimizer, monitored (`kind` a bench_steps config) or not ("none")."""

    def __init__(self, model: str, kind: str, device: str, smoke: bool, out: str,
                 keep_hooks: bool = False, layers: Optional[int] = None):
        n = {} if layers is None else {"layers": layers, "smoke_layers": layers}
        self.m, self.fwd, self.opt, self.ids = bench_steps.build(model, device, smoke, **n)
        self.device = device
        cfg = bench_steps.config(kind)
        self.marks: dict = {}
        opt = self.opt
        self.handles = [opt.register_step_pre_hook(self._mark("pre0")),
                        opt.register_step_post_hook(self._mark("post0"))]
        self.mon = None
        if cfg is not None:
            import stabilitywatch as sw
            self.mon = sw.watch(self.m, opt, config=cfg, run_dir=out)
            for name in ("_begin", "_end", "observe_loss"):
                setattr(self.mon, name, _Timed(getattr(self.mon, name)))
            self.mon._handle = _FrameTimed(self.mon._handle)   # looked up per frame
            # as on a compiled model: the forward hooks stay registered on every step
            self.mon.taps.keep_forward = keep_hooks
        self.handles += [opt.register_step_pre_hook(self._mark("pre1")),
                         opt.register_step_post_hook(self._mark("post1"))]
        self.watched = [mod for _, mod in self.mon.modules] if self.mon is not None else []
        self.rows: dict = {"sampled": [], "unsampled": [], "every": []}
        self.worker = None   # the autograd engine's thread that runs a CUDA backward
        self._last = None    # (row kept at the last step or None, its processing, sinks CPU)

    def _learn_worker(self, grad):
        if threading.get_ident() != threading.main_thread().ident:
            self.worker = threading.get_ident()
        return grad

    def _mark(self, name):
        def hook(*_):
            self.marks[name] = time.thread_time()
        return hook

    def step(self, i: int, sync: bool, keep: bool) -> None:
        mon, device, ids = self.mon, self.device, self.ids
        do_sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        if sync:
            do_sync()
        w0, c0, a0 = time.perf_counter(), time.thread_time(), _pinned_allocs(device)
        b0 = _cpu_of(self.worker)
        p0, s0 = _processing_cpu(mon), _sinks_cpu(mon)
        if self._last is not None and self._last[0] is not None:
            # the monitor's threads from that step's start to this one's (the other runs'
            # interleaved steps included: what its frame costs them happens after its end)
            row, lp, ls = self._last
            row["to_next"], row["sinks_to_next"] = p0 - lp, s0 - ls
        q0 = mon.processor.waited if mon is not None else 0.0
        ctx = mon.step(i, batch=ids) if mon is not None else bench_steps._null()
        part = dict.fromkeys(PARTS, 0.0)
        with ctx:
            sampled = mon is not None and mon.sampling
            hooks = sum(len(mod._forward_hooks) for mod in self.watched)
            t = time.thread_time()
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = self.fwd(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   ids[:, 1:].reshape(-1))
            part["forward"] = time.thread_time() - t
            if self.worker is None and loss.is_cuda:
                loss.register_hook(self._learn_worker)
            t = time.thread_time()
            loss.backward()
            part["backward"] = time.thread_time() - t
            if mon is not None:
                mon.observe_loss(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        c1 = time.thread_time()
        if sync:
            do_sync()
        w1 = time.perf_counter()
        m = self.marks
        part["optimizer taps"] = m["pre1"] - m["pre0"] + m["post1"] - m["post0"]
        if mon is not None:
            part["begin"], part["end"] = mon._begin.take(), mon._end.take()
            part["observe_loss"] = mon.observe_loss.take()
        row = None
        if keep:
            k = "every" if mon is None else "sampled" if sampled else "unsampled"
            row = dict(part, cpu=c1 - c0, wall=w1 - w0, hooks=hooks,
                       bwd_thread=_cpu_of(self.worker) - b0 if b0 else 0.0,
                       processing=_processing_cpu(mon) - p0,
                       pinned=_pinned_allocs(device) - a0,
                       waited=mon.processor.waited - q0 if mon else 0.0, step=i)
            self.rows[k].append(row)
        self._last = (row, p0, s0)

    def forward_ab(self, reps: int) -> tuple[float, float, int]:
        """The forward alone, between steps, with the monitor's forward hooks removed and
        registered (returning at once, as on an unsampled step), `reps` alternating pairs:
        the median CPU time without them and the median of the pairs' differences."""
        taps, times = self.mon.taps, {False: [], True: []}
        for _ in range(reps):
            for hooks in (False, True):
                taps.keep_forward = hooks
                taps.set_forward(hooks)
                t = time.thread_time()
                with torch.autocast(self.device, dtype=torch.bfloat16):
                    self.fwd(input_ids=self.ids)
                times[hooks].append(time.thread_time() - t)
        taps.keep_forward = False
        diff = statistics.median(b - a for a, b in zip(times[False], times[True]))
        return statistics.median(times[False]), diff, len(self.watched)

    def close(self) -> dict:
        if self.mon is not None:
            self.mon.close()
            for v in self.rows.values():
                for r in v:   # the processing thread's CPU in the frame of that step
                    r["frame"] = self.mon._handle.cpu.get(r["step"], 0.0)
        for h in self.handles:
            h.remove()
        # the last step kept has no next step: the spans to the next step average the others
        return {k: {f: statistics.mean(r[f] for r in v if f in r) for f in v[0] if f != "step"}
                | {f: statistics.mean([r[f] for r in v if f in r] or [0.0])
                   for f in ("to_next", "sinks_to_next")} | {"n": len(v)}
                for k, v in self.rows.items() if v}


def run_group(model: str, kind: str, device: str, smoke: bool, steps: int, skip: int,
              sync: bool, out: str, keep_hooks: bool, layers: Optional[int] = None) -> list[dict]:
    """The unmonitored run, the monitored one (and with `keep_hooks` the monitored one whose
    forward hooks stay registered), their steps interleaved: the machine's drift falls on
    all of them."""
    runs = [_Run(model, "none", device, smoke, f"{out}-none", layers=layers),
            _Run(model, kind, device, smoke, f"{out}-mon", layers=layers)]
    if keep_hooks:
        runs.append(_Run(model, kind, device, smoke, f"{out}-kept", keep_hooks=True,
                         layers=layers))
    for i in range(steps):
        for r in (runs if i % 2 else runs[::-1]):
            r.step(i, sync, i >= skip)
    ab = runs[1].forward_ab(100)
    return [r.close() for r in runs] + [ab]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--config", default="default")
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--skip", type=int, default=15, help="steps left out at the start")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sync", action="store_true", help="synchronize around each step")
    p.add_argument("--keep-hooks", action="store_true", help="also a monitored run whose forward "
                   "hooks stay registered on every step (as on a compiled model)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU always has them)")
    p.add_argument("--layers", type=int, default=None, help="the model's layers (default: 8 at "
                   "the full size, 2 at the tiny one)")
    a = p.parse_args(argv)
    smoke = a.smoke or a.device == "cpu"
    if a.skip >= a.steps:
        p.error("--skip must be below --steps")
    print(f"# bench_unsampled: {a.model}{' (tiny)' if smoke else ''}, layers "
          f"{a.layers or 'as built'}, on {a.device}, torch "
          f"{torch.__version__}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"config {a.config!r}, steps {a.skip}..{a.steps - 1} x {a.repeats}"
          f"{', synchronized' if a.sync else ''}")
    labels = ["none", a.config] + ([f"{a.config}, forward hooks kept"] if a.keep_hooks else [])
    runs: dict = {k: [] for k in labels}
    ab = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            *got, pair = run_group(a.model, a.config, a.device, smoke, a.steps, a.skip, a.sync,
                                   f"{tmp}/{r}", a.keep_hooks, a.layers)
            for k, g in zip(labels, got):
                runs[k].append(g)
            ab.append(pair)
    base = {f: statistics.median(x["every"][f] for x in runs["none"])
            for f in ("forward", "backward", "cpu", "wall", "bwd_thread")}
    ms = lambda v: f"{v * 1e3:.3f}"  # noqa: E731
    print("| run | step kind (count) | begin | forward (+hooks) | backward (+hooks) | "
          "observe_loss | "
          "optimizer taps | end | monitor's parts | step CPU | its monitor's part | "
          "backward thread CPU | its monitor's part | wall | its monitor's part | "
          "forward hooks | pinned allocs | waited | processing thread CPU | its frame's "
          "processing CPU | processing thread CPU, step start to the next | sink threads CPU, "
          "step start to the next |")
    print("|---|---|" + "---:|" * 20)
    print(f"| no monitor | every ({runs['none'][0]['every']['n']}) | | {ms(base['forward'])} | "
          f"{ms(base['backward'])} | | | | | {ms(base['cpu'])} | | {ms(base['bwd_thread'])} | | "
          f"{ms(base['wall'])} | | 0 | | | | | | |")
    for label, kind in [(k, kind) for k in labels[1:] for kind in ("unsampled", "sampled")]:
        got = [x[kind] for x in runs[label] if kind in x]
        if not got:
            continue
        med = {f: statistics.median(g[f] for g in got) for f in got[0]}
        med["forward"] -= base["forward"]
        med["backward"] -= base["backward"]
        own = sum(med[f] for f in PARTS)
        print(f"| {label} | {kind} ({got[0]['n']}) | {ms(med['begin'])} | "
              f"{med['forward'] * 1e3:+.3f} | "
              f"{med['backward'] * 1e3:+.3f} | {ms(med['observe_loss'])} | "
              f"{ms(med['optimizer taps'])} | {ms(med['end'])} | {own * 1e3:.3f} | "
              f"{ms(med['cpu'])} | {(med['cpu'] - base['cpu']) * 1e3:+.3f} | "
              f"{ms(med['bwd_thread'])} | {(med['bwd_thread'] - base['bwd_thread']) * 1e3:+.3f} | "
              f"{ms(med['wall'])} | "
              f"{(med['wall'] - base['wall']) * 1e3:+.3f} | {med['hooks']:.0f} | "
              f"{med['pinned']:.2f} | {ms(med['waited'])} | {ms(med['processing'])} | "
              f"{ms(med['frame'])} | {ms(med['to_next'])} | {ms(med['sinks_to_next'])} |")
    print("(ms per step; forward/backward and the step's monitor's part: against the "
          "unmonitored run's mean, so within the run's noise)")
    off, diff = (statistics.median(x[i] for x in ab) for i in (0, 1))
    print(f"forward alone, 100 alternating pairs: {off * 1e3:.3f} ms without the monitor's "
          f"forward hooks; with them (returning at once) {diff * 1e6:+.0f} us (the pairs' "
          f"median difference) for {ab[0][2]} hooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
