"""The training thread's own time per step, with frame processing on its thread or inline.

    python benchmarks/bench_host.py [--device cpu|cuda] [--models "demo;gpt2"] [--steps 60]
        [--repeats 2] [--configs "no monitor;default;default, inline;every=1;every=1, inline"]

For each model and configuration, every step is timed on the training thread: CPU time of the
training thread itself (`time.thread_time`) and wall time, split into sampled steps (the
schedule reads more than the loss) and unsampled ones, from step `--skip` on (the default
config samples every step of its warmup). The "monitor's part" columns subtract the
unmonitored run's mean step (step kind "every"), measured in the same run; the processing
thread's CPU time (`time.pthread_getcpuclockid`) is summed over the run and given per step; "of it in the step
end" is the training thread's CPU time inside the step end (reading the frames, queueing them;
inline: processing them too). The configurations
run interleaved, `--repeats` times; the table shows medians over repeats.

Models: "demo" (stabilitywatch.demo's TinyGPT, bf16 autocast, AdamW) and "gpt2" (HF GPT-2
from a config, random init: on the CPU 4 layers, d 128, vocab 1024, batch 4 x 64; on CUDA
GPT-2 small, batch 8 x 1024, bf16 autocast). On CUDA the wall time is the host's (no
synchronisation inside the loop); the last column is the mean step with a final synchronize.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

import stabilitywatch as sw
from stabilitywatch import demo
from stabilitywatch.processing import THREAD_NAME

CONFIGS = {
    "no monitor": None,
    "default": dict(),
    "default, inline": dict(processing="inline"),
    "every=1": dict(every=1),
    "every=1, inline": dict(every=1, processing="inline"),
}


def _gpt2(device: str, smoke: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if device == "cuda" and not smoke:
        cfg, batch, seq = GPT2Config(), 8, 1024
    else:
        cfg = GPT2Config(n_layer=2 if smoke else 4, n_embd=64 if smoke else 128, n_head=4,
                         vocab_size=1024, n_positions=64, bos_token_id=0, eos_token_id=0)
        batch, seq = 4, 64
    model = GPT2LMHeadModel(cfg).to(device)
    gen = torch.Generator().manual_seed(1)

    def batch_at(step):
        return {"idx": torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)}

    def loss_of(m, b):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = m(b["idx"]).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, cfg.vocab_size),
                               b["idx"][:, 1:].reshape(-1))
    return model, batch_at, loss_of


def _demo(device: str, smoke: bool):
    model = demo.build_model().to(device)
    gen = torch.Generator().manual_seed(1)
    return model, (lambda step: demo.make_batch(gen, device)), demo.train_step


MODELS = {"demo": _demo, "gpt2": _gpt2}


def _cpu_of(thread: "threading.Thread | None") -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError, ProcessLookupError):   # the thread has ended
        return 0.0


def run_once(model_name: str, cfg: "dict | None", device: str, steps: int, skip: int,
             run_dir: str, smoke: bool) -> dict:
    model, batch_at, loss_of = MODELS[model_name](device, smoke)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = (sw.watch(model, opt, config=sw.Config(sinks=("jsonl",), **cfg), run_dir=run_dir)
           if cfg is not None else None)
    kinds: dict = {"sampled": ([], [], []), "unsampled": ([], [], []), "every": ([], [], [])}
    in_end = [0.0]   # the training thread's CPU time inside the step end (Monitor._end)
    if mon is not None:
        end = mon._end

        def timed_end():
            t = time.thread_time()
            try:
                end()
            finally:
                in_end[0] += time.thread_time() - t
        mon._end = timed_end
    proc_cpu, seen = 0.0, {}
    t_all = None
    try:
        for step in range(steps):
            if step == skip:
                if device == "cuda":
                    torch.cuda.synchronize()
                t_all = time.perf_counter()
            batch = batch_at(step)
            c0, w0, e0 = time.thread_time(), time.perf_counter(), in_end[0]
            sampled = False
            if mon is None:
                loss = loss_of(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with mon.step(step, batch=batch):
                    sampled = mon.sampling
                    loss = loss_of(model, batch)
                    loss.backward()
                    mon.observe_loss(loss)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            c1, w1 = time.thread_time(), time.perf_counter()
            if step >= skip:
                kind = "every" if mon is None else "sampled" if sampled else "unsampled"
                cpu, wall, ends = kinds[kind]
                cpu.append((c1 - c0) * 1e3)
                wall.append((w1 - w0) * 1e3)
                ends.append((in_end[0] - e0) * 1e3)
            for t in threading.enumerate():   # the processing thread (a fresh one if replaced)
                if t.name == THREAD_NAME:
                    seen[t.ident] = max(seen.get(t.ident, 0.0), _cpu_of(t))
        if device == "cuda":
            torch.cuda.synchronize()
        mean_step = (time.perf_counter() - t_all) * 1e3 / max(1, steps - skip)
    finally:
        if mon is not None:
            mon.close()
    proc_cpu = sum(seen.values())
    out = {"mean_step": mean_step, "proc_cpu": proc_cpu * 1e3 / steps}
    for k, (cpu, wall, ends) in kinds.items():
        out[k] = (statistics.mean(cpu), statistics.mean(wall), len(cpu),
                  statistics.mean(ends)) if cpu else None
    if mon is not None:
        out["waited"] = mon.processor.waited * 1e3 / steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="demo;gpt2")
    p.add_argument("--configs", default=";".join(CONFIGS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=12, help="steps left out at the start")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.skip, a.repeats = 2, 1, 1
        a.configs = "no monitor;default;default, inline"
    names = [n.strip() for n in a.configs.split(";") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    if "no monitor" not in names:
        names.insert(0, "no monitor")
    models = [m.strip() for m in a.models.split(";") if m.strip()]
    print(f"# bench_host: device {a.device}, torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, steps {a.skip}..{a.steps - 1} x {a.repeats}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            res: dict = {n: [] for n in names}
            run_once(model, None, a.device, 2, 0, f"{tmp}/warm-{model}", a.smoke)
            for r in range(a.repeats):
                for n in names:
                    res[n].append(run_once(model, CONFIGS[n], a.device, a.steps, a.skip,
                                           f"{tmp}/{model}-{r}-{len(res[n])}-{names.index(n)}",
                                           a.smoke))
            rows += _rows(model, res)
    print("| model | configuration | step kind (count) | training thread CPU ms | monitor's "
          "part | of it in the step end | wall ms | monitor's part | processing thread CPU "
          "ms/step | waited ms/step | mean step ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


def _med(runs: list, f) -> float:
    vals = [f(x) for x in runs if f(x) is not None]
    return statistics.median(vals) if vals else float("nan")


def _rows(model: str, res: dict) -> list:
    out = []
    base = res["no monitor"]
    for n, runs in res.items():
        bcpu = _med(base, lambda x: x["every"] and x["every"][0])
        bwall = _med(base, lambda x: x["every"] and x["every"][1])
        for kind in ("every", "sampled", "unsampled"):
            if all(x[kind] is None for x in runs):
                continue
            count = next(x[kind][2] for x in runs if x[kind] is not None)
            cpu = _med(runs, lambda x: x[kind] and x[kind][0])
            wall = _med(runs, lambda x: x[kind] and x[kind][1])
            mon = n != "no monitor"
            in_end = _med(runs, lambda x: x[kind] and x[kind][3])
            out.append([model, n, f"{kind} ({count})", f"{cpu:.2f}",
                        f"{cpu - bcpu:+.2f}" if mon else "", f"{in_end:.2f}" if mon else "",
                        f"{wall:.2f}",
                        f"{wall - bwall:+.2f}" if mon else "",
                        f"{_med(runs, lambda x: x['proc_cpu']):.2f}" if mon else "",
                        f"{_med(runs, lambda x: x.get('waited', 0.0)):.2f}" if mon else "",
                        f"{_med(runs, lambda x: x['mean_step']):.2f}"])
    return out


if __name__ == "__main__":
    sys.exit(main())
