"""The zoo's faults on HF GPT-2 small (124M, from its config, random init) with the default
Config(): the first incident of warning or worse (step, severity, root module and role) and the
number of alerts each fault raised; a clean run for false alarms.

    python benchmarks/zoo_gpt2_small.py                 # CUDA: batch 16 x 1024, bf16 autocast,
                                                        # fused AdamW lr 3e-4
    python benchmarks/zoo_gpt2_small.py --tiny --device cpu   # a 2-layer d=32 smoke run

A fault lands before the forward of its step: 30 is a sampled step (every=10), 23 is not.
`--faults "bad_batch;clean"` runs some of them.

The bad batch's run trains on the language over the first 64 token ids (`BAD_BATCH_ALPHABET`),
which GPT-2 small learns within its first 20 steps at lr 3e-4, and its bad batch is uniform
over the whole vocabulary (a corrupt shard): a bad batch can only spike the loss of a model that
has learnt its data; over all 50257 ids the model at step 23-30 has not learnt the language yet,
and a random batch costs it no more than a real one. Its rows show the loss of the step before
the fault and of the fault step.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import stabilitywatch as sw  # noqa: E402


def build(tiny: bool, device):
    torch.manual_seed(0)
    cfg = (GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                      bos_token_id=0, eos_token_id=0) if tiny else GPT2Config())
    return GPT2LMHeadModel(cfg).to(device)


BAD_BATCH_ALPHABET = 64


def data(vocab, seq, batch, device, alphabet=None):
    """A learnable language over the first `alphabet` token ids (default: every id): next =
    (3 * prev + 1) mod alphabet, 10% noise tokens; a bad batch is uniform over all `vocab`."""
    full, vocab = vocab, alphabet or vocab

    def at(step, bad=False):
        g = torch.Generator().manual_seed(100003 + step)
        if bad:   # a corrupt shard: uniform random tokens
            s = torch.randint(0, full, (batch, seq + 1), generator=g)
        else:
            s = [torch.randint(0, vocab, (batch, 1), generator=g)]
            for _ in range(seq):
                s.append((3 * s[-1] + 1) % vocab)
            s = torch.cat(s, 1)
            noise = torch.rand(s.shape, generator=g) < 0.1
            s = torch.where(noise, torch.randint(0, vocab, s.shape, generator=g), s)
        s = s.to(device)
        return s[:, :-1], s[:, 1:]
    return at


def layers(model):
    n = model.config.n_layer
    deep, mid = min(6, n - 1), min(3, n - 1)
    return (f"transformer.h.{deep}.mlp.c_fc", f"transformer.h.{deep}.mlp.c_proj",
            f"transformer.h.{mid}.attn.c_proj")


def run(name, fault, args):
    device = torch.device(args.device)
    model = build(args.tiny, device)
    vocab = model.config.vocab_size
    seq, batch = (16, 8) if args.tiny else (1024, 16)
    fused = device.type == "cuda"
    base_lr = 3e-3 if args.tiny else 3e-4
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, fused=fused)
    at = data(vocab, seq, batch, device,
              alphabet=min(BAD_BATCH_ALPHABET, vocab) if name == "bad_batch" else None)
    losses = {}
    fc, proj, attn = layers(model)
    state = {"on": False}

    def nan_grad(mod, a, out):
        if state["on"] and name == "backward_nan" and out.requires_grad:
            def poison(g):
                g = g.clone()
                g.view(-1)[3] = float("nan")
                return g
            out.register_hook(poison)

    def inf_out(mod, a, out):
        if state["on"] and name == "forward_inf":
            out = out.clone()
            out.view(-1)[3] = float("inf")
            return out
    model.get_submodule(attn).register_forward_hook(nan_grad)
    model.get_submodule(fc).register_forward_hook(inf_out)
    steps = args.clean_steps if name == "clean" else fault + 12
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
           else contextlib.nullcontext())
    t0 = time.perf_counter()
    mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",)), run_dir=tempfile.mkdtemp())
    with mon:
        for step in range(steps):
            state["on"] = step == fault
            if name == "clean":   # warm-up: GPT-2 small at a constant 3e-4 from step 0 diverges
                for g in opt.param_groups:
                    g["lr"] = base_lr * min(1.0, (step + 1) / 100)
            if step == fault:
                with torch.no_grad():
                    if name == "weight_jump":
                        model.get_submodule(fc).weight.mul_(1e4)
                    elif name == "bit_flip":
                        model.get_submodule(proj).weight.view(-1).view(torch.int32)[5] ^= 1 << 30
                    elif name == "lr_blowup":
                        for g in opt.param_groups:
                            g["lr"] *= 1000.0
            x, y = at(step, bad=name == "bad_batch" and step == fault)
            with mon.step(step, batch=x):
                with ctx:
                    logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
                loss.backward()
                mon.observe_loss(loss)
                if step in (fault - 1, fault):
                    losses[step] = loss.detach()
                opt.step()
                opt.zero_grad(set_to_none=True)
    secs = time.perf_counter() - t0
    roots = [a for a in mon.alerts if a.root and a.severity.value != "info"]
    first = roots[0] if roots else None
    got = (f"{first.step} {first.severity.value} {first.detector} `{first.module or '<model>'}` "
           f"`{first.tensor}`" if first else "none")
    n_inc = len({a.incident for a in mon.alerts})
    if name == "bad_batch":
        got += " (loss {:.2f} -> {:.2f})".format(*(float(losses[k]) for k in sorted(losses)))
    return got, len(mon.alerts), n_inc, secs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--clean-steps", type=int, default=200)
    p.add_argument("--faults", default="", help="; separated (default: every fault and clean)")
    args = p.parse_args()
    faults = ["weight_jump", "bit_flip", "backward_nan", "forward_inf", "lr_blowup", "bad_batch"]
    chosen = [f for f in args.faults.split(";") if f] or faults + ["clean"]
    if any(f not in faults + ["clean"] for f in chosen):
        p.error(f"--faults: from {faults + ['clean']}")
    faults = [f for f in faults if f in chosen]
    print("| fault | fault step | first incident (step severity detector module role) | alerts "
          "| incidents | run time |")
    print("|---|---:|---|---:|---:|---:|")
    for name in faults:
        for fault in (30, 23):
            got, n, inc, secs = run(name, fault, args)
            print(f"| {name} | {fault} | {got} | {n} | {inc} | {secs:.1f} s |", flush=True)
    if "clean" in chosen:
        got, n, inc, secs = run("clean", -1, args)
        print(f"| clean ({args.clean_steps} steps) | - | {got} | {n} | {inc} | {secs:.1f} s |")
        if not math.isfinite(secs):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
