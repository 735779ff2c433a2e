"""The monitor's cost on the training steps users run, same-run ratios, in one run:

    python benchmarks/bench_steps.py [--models "gpt2;gpt2-compiled;llama;llama-fp8"]
        [--configs "none;default;every=1"] [--repeats 2] [--breakdown llama] [--layers 8]
    python benchmarks/bench_steps.py --smoke          # CPU: tiny shapes

Models (from configs, random init, fused AdamW on the GPU): HF GPT-2 small (`GPT2Config()`,
batch 16 x 1024, bf16 autocast), eager and under `torch.compile`; HF Llama (8 layers, d 1024,
ffn 2816, 16 heads, vocab 32000, batch 8 x 1024, bf16 autocast), eager; the same Llama in bf16
under torchao float8 training (tensorwise) and `torch.compile` (the wheel carried to the GPU
machine). Configurations: no monitor (`none`), the default `Config()` (`default`), and
`Config(every=1)` (`every=1`); a `,nocap` suffix adds `capture=()` (no snapshots or bundles),
`,nosinks` adds `sinks=()`, `,nosentinel` adds `sentinel=False`, `,inline` adds
`processing="inline"` (frames processed on the training thread), `,nohold` reads each hook's
tensor at its hook instead of holding it for a shared launch (stats/held.py). ms/step is the mean over steps
15-44 with one sync at the end (three sampled steps of the default config: 20, 30, 40), the
median round; the overhead range is over rounds, each against its own round's baseline.

A compiled model prints each warm-up step that takes more than a second as it ends (a compile
or a recompile: its seconds, dynamo's frames and unique graphs so far), so a run stopped by a
time limit still shows where its time went. `--layers N` gives the Llamas N layers (compile
time grows with them).

`--blocks N` runs the configurations of a model side by side instead (one model, optimizer and
monitor each, built once): after `--skip` steps of each, N rounds of `--block-steps` steps of
each configuration in turn (the order rotating every round), a sync around each block and,
within its time, a wait for its monitor's frame processing to catch up (so that none runs on into
the next configuration's block); the ratio is the configuration's total time over `none`'s, and the range is over rounds. A host
whose speed drifts moves every configuration alike. It prints where the cost budget set each
monitor's cadence (`Config.cost_budget`, stabilitywatch/pacing.py). A `fixed` configuration
is the default at `cost_budget=0` (statistics every 10th step whatever they cost).

`--breakdown MODEL` profiles 4 steps of each configuration of that model (torch.profiler, CUDA
activity): per step, the GPU time of the monitor's Triton kernels, of every kernel and copy,
the GPU's idle time inside the step (where it waited for the host), and the launches; the
monitor's share is the difference from `none`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import stabilitywatch as sw

MODELS = ["gpt2", "gpt2-compiled", "llama", "llama-fp8"]
OURS = ("_sentinel_kernel", "_multi_row_kernel", "_tile_stats_kernel", "_row_stats_kernel",
        "_multi_tile_kernel")


def build(model: str, device: str, smoke: bool, layers: int = 8, smoke_layers: int = 2):
    """smoke: the tiny shapes (d 64) with `smoke_layers` layers; else the full ones, the
    Llamas with `layers` layers."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if model.startswith("gpt2"):
        cfg = (GPT2Config(n_layer=smoke_layers, n_embd=64, n_head=4, vocab_size=256,
                          n_positions=64) if smoke else GPT2Config())
        m, batch, seq = GPT2LMHeadModel(cfg), (2 if smoke else 16), (32 if smoke else 1024)
        vocab = cfg.vocab_size
    else:
        d = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=smoke_layers, num_attention_heads=4,
                 num_key_value_heads=4) if smoke else dict(
                 vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16)
        m, batch, seq = LlamaForCausalLM(LlamaConfig(**d, max_position_embeddings=1024)), \
            (2 if smoke else 8), (32 if smoke else 1024)
        vocab = d["vocab_size"]
    m = m.to(device)
    if model == "llama-fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        if device == "cuda":
            m = m.to(torch.bfloat16)
        convert_to_float8_training(m, config=Float8LinearConfig(emulate=device != "cuda"),
                                   module_filter_fn=lambda mod, name: name != "lm_head")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device == "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    fwd = torch.compile(m) if model.endswith(("compiled", "fp8")) else m
    return m, fwd, opt, ids


def config(kind: str):
    if kind == "none":
        return None
    base, *flags = kind.split(",")
    kw = {"every=1": {"every": 1}, "fixed": {"cost_budget": 0.0}}.get(base, {})
    if base not in ("default", "every=1", "fixed"):
        raise ValueError(f"unknown configuration {base!r}")
    for f in flags:
        if f == "nohold":   # each hook's tensor read at its hook (watched() applies it)
            continue
        kw.update({"nocap": {"capture": ()}, "nosinks": {"sinks": ()},
                   "nosentinel": {"sentinel": False}, "inline": {"processing": "inline"}}[f])
    return sw.Config(**kw)


def watched(m, opt, kind: str, out: str):
    """The monitor of configuration `kind` on m (None for "none")."""
    cfg = config(kind)
    if cfg is None:
        return None
    mon = sw.watch(m, opt, config=cfg, run_dir=out)
    if "nohold" in kind.split(","):
        mon.buffer.hold_on = ()
    return mon


def step(fwd, opt, ids, mon, i, device):
    ctx = mon.step(i, batch=ids) if mon else _null()
    with ctx:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = fwd(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))
        loss.backward()
        if mon:
            mon.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def run(model, kind, device, smoke, out, profile=None, layers: int = 8):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    m, fwd, opt, ids = build(model, device, smoke, layers)
    compiled = fwd is not m
    if compiled:   # dynamo's counters of this run: graph breaks, frames compiled
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
    mon = watched(m, opt, kind, out)
    warm, steps = (2, 3) if smoke else (15, 30)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = 0.0
    for i in range(warm + steps):
        if i == warm:
            sync()
            t0 = time.perf_counter()
        t = time.perf_counter()
        step(fwd, opt, ids, mon, i, device)
        if compiled and i < warm:
            sync()
            dt = time.perf_counter() - t
            if dt > 1.0:   # a compile or a recompile
                print(f"# {model} {kind}: step {i} took {dt:.1f} s; frames "
                      f"{counters['frames'].get('total', 0)}, graphs "
                      f"{counters['stats'].get('unique_graphs', 0)}", flush=True)
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    prof = None
    if profile is not None:   # 4 steps, the first of them sampled by the default config
        from torch.profiler import ProfilerActivity, profile as _profile
        first = warm + steps + (-(warm + steps)) % 10
        for i in range(warm + steps, first):
            step(fwd, opt, ids, mon, i, device)
        sync()
        with _profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for i in range(first, first + 4):
                step(fwd, opt, ids, mon, i, device)
            sync()
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "trace.json")
        p.export_chrome_trace(path)
        prof = gpu_breakdown(path, 4)
    alerts = 0
    if mon:
        mon.close()
        alerts = len(mon.alerts)
    if compiled:
        print(f"# {model} {kind}: graph breaks {sum(counters['graph_break'].values())}, frames "
              f"{dict(counters['frames'])}, graphs {counters['stats'].get('unique_graphs', 0)}",
              flush=True)
    return ms, prof, alerts


def side_by_side(model, kinds, device, smoke, out, blocks, block_steps, skip, layers=8):
    """{kind: [seconds of each round's block]} and the monitors' cadence changes."""
    built = {}
    for k in kinds:
        gc.collect()
        m, fwd, opt, ids = build(model, device, smoke, layers)
        mon = watched(m, opt, k, f"{out}/{k}")
        built[k] = [fwd, opt, ids, mon, 0]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    spans = {k: [] for k in kinds}   # (step, CUDA event at its start, event at its end)

    def go(k, n, timed=False):
        b = built[k]
        marks = []
        for _ in range(n):
            if timed and device == "cuda":
                marks.append((b[4], torch.cuda.Event(enable_timing=True)))
                marks[-1][1].record()
            step(b[0], b[1], b[2], b[3], b[4], device)
            b[4] += 1
        if marks:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            ends = [m[1] for m in marks[1:]] + [end]
            spans[k] += [(s, a, e) for (s, a), e in zip(marks, ends)]

    for k in kinds:
        t = time.perf_counter()
        go(k, skip)
        sync()
        print(f"# {model} {k}: {skip} warm-up steps in {time.perf_counter() - t:.1f} s",
              flush=True)
    times = {k: [] for k in kinds}
    for r in range(blocks):
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            sync()
            t = time.perf_counter()
            go(k, block_steps, timed=True)
            sync()
            # the block's frames queued by now are processed within its time: none of its
            # processing runs on while the next configuration's block is timed
            if built[k][3] is not None:
                built[k][3].processor.wait_all()
            times[k].append(time.perf_counter() - t)
    by_phase = {k: [[] for _ in range(10)] for k in kinds}   # GPU ms by step % 10
    for k, lst in spans.items():
        for st, a, e in lst:
            by_phase[k][st % 10].append(a.elapsed_time(e))
    if any(any(v) for v in by_phase.values()):
        print(f"\n{model}: mean span from a step's start to the next's on the GPU stream (ms), "
              f"by step % 10 (the fixed cadence samples 0)")
        print("| configuration | " + " | ".join(f"{i}" for i in range(10)) + " |")
        print("|---|" + "---:|" * 10)
        for k, ph in by_phase.items():
            print(f"| {k} | " + " | ".join(f"{sum(v) / len(v):.2f}" if v else "" for v in ph)
                  + " |")
    cadence = {}
    for k, b in built.items():
        if b[3] is not None:
            cadence[k] = list(b[3].pacer.changes)
            b[3].close()
    return times, cadence


def print_side_by_side(model, kinds, times, cadence, block_steps):
    base = sum(times["none"])
    n = len(times["none"]) * block_steps
    print(f"\n{model}, {len(times['none'])} rounds of {block_steps} steps side by side")
    print("| model | configuration | ms/step | overhead | range over rounds | cadence |")
    print("|---|---|---:|---:|---|---|")
    for k in kinds:
        tot = sum(times[k])
        per = sorted(a / b - 1 for a, b in zip(times[k], times["none"]))
        where = "; ".join(f"every {c['every']} from step {c['step']} (sampled +"
                          f"{c['sampled_extra_ms']:.1f} ms, step {c['step_ms']:.1f} ms, sentinel "
                          f"{c['sentinel_ms']:.2f} ms)" for c in cadence.get(k, []))
        print(f"| {model} | {k} | {tot * 1e3 / n:.2f} | {tot / base - 1:+.2%} | "
              f"{per[0]:+.1%} .. {per[-1]:+.1%} | {where} |", flush=True)


def gpu_breakdown(path: str, steps: int) -> dict:
    """Per step: the monitor's Triton kernels' time, every kernel's and copy's, the GPU's idle
    time between the first and the last of them, the launches (ms, ms, ms, count)."""
    with open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ev:
        return {}
    ev.sort(key=lambda e: e["ts"])
    ours = sum(e["dur"] for e in ev if e["name"].startswith(OURS))
    busy, end = 0.0, ev[0]["ts"]
    for e in ev:   # the union of the busy intervals
        s, t = max(e["ts"], end), e["ts"] + e["dur"]
        if t > s:
            busy += t - s
        end = max(end, t)
    span = end - ev[0]["ts"]
    n = sum(1 for e in ev if e["name"].startswith(OURS))
    return dict(ours=ours / 1e3 / steps, busy=busy / 1e3 / steps,
                idle=(span - busy) / 1e3 / steps, launches=len(ev) / steps,
                our_launches=n / steps)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=";".join(MODELS))
    p.add_argument("--configs", default="none;default;every=1")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--breakdown", default="", help="a model to profile (4 steps per config)")
    p.add_argument("--layers", type=int, default=8, help="layers of the Llamas (GPU sizes)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--blocks", type=int, default=0, help="side by side: rounds of blocks")
    p.add_argument("--block-steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=60, help="side by side: warm-up steps of each")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    smoke = a.smoke or device == "cpu"
    models = [m for m in a.models.split(";") if m]
    kinds = [k for k in a.configs.split(";") if k]
    if "none" not in kinds or any(m not in MODELS for m in models):
        p.error(f"--models from {MODELS}; --configs must include none")
    for k in kinds:
        config(k)   # a bad name fails before any run
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if a.blocks:
        print(f"# bench_steps side by side on {name}, torch {torch.__version__}")
        with tempfile.TemporaryDirectory() as tmp:
            for mdl in models:
                times, cadence = side_by_side(mdl, kinds, device, smoke, f"{tmp}/{mdl}", a.blocks,
                                              a.block_steps, a.skip, a.layers)
                print_side_by_side(mdl, kinds, times, cadence, a.block_steps)
        return 0
    res: dict = {}
    brk: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for mdl in models:
                for i, kind in enumerate(kinds):
                    prof = mdl == a.breakdown and r == 0
                    ms, b, n = run(mdl, kind, device, smoke, f"{tmp}/{r}-{mdl}-{i}",
                                   profile=True if prof else None, layers=a.layers)
                    res.setdefault((mdl, kind), []).append((ms, n))
                    if prof:
                        brk[kind] = b
                    print(f"# round {r} {mdl} {kind}: {ms:.2f} ms/step, {n} alerts", flush=True)
    print(f"# bench_steps on {name}, torch {torch.__version__}; steps 15-44, {a.repeats} "
          f"round(s)")
    print("| model | configuration | ms/step | overhead | range | alerts |")
    print("|---|---|---:|---:|---|---:|")
    for mdl in models:
        base = res[(mdl, "none")]
        for kind in kinds:
            over = sorted(v[0] / b[0] - 1 for v, b in zip(res[(mdl, kind)], base))
            med = sorted(v[0] for v in res[(mdl, kind)])[len(base) // 2]
            bmed = sorted(v[0] for v in base)[len(base) // 2]
            print(f"| {mdl} | {kind} | {med:.2f} | {med / bmed - 1:+.1%} | {over[0]:+.1%} .. "
                  f"{over[-1]:+.1%} | {res[(mdl, kind)][0][1]} |")
    if brk:
        print(f"\n{a.breakdown}, per step over 4 profiled steps (the first sampled by the default):")
        print("| configuration | monitor kernels ms | GPU busy ms | GPU idle ms | launches | "
              "monitor launches |")
        print("|---|---:|---:|---:|---:|---:|")
        for kind, b in brk.items():
            if b:
                print(f"| {kind} | {b['ours']:.2f} | {b['busy']:.2f} | {b['idle']:.2f} | "
                      f"{b['launches']:.0f} | {b['our_launches']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
