"""How many keys the W&B and TensorBoard sinks log per sampled step, by default.

    python benchmarks/dashboard_keys.py [--model gpt2|mlp] [--preset fp8] [--tiny]

Runs one monitored training step of the model (random init, CPU, one tiny batch) with the JSONL
sink, reads the step's records back from stats.jsonl and counts the keys the dashboards make of
them (sinks/dashboard.py: scalars and exponent histograms; the step key not counted).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import stabilitywatch as sw  # noqa: E402
from stabilitywatch.sinks.dashboard import Dashboard  # noqa: E402


def build(name: str, tiny: bool = False):
    """The model and its loss. tiny: GPT-2 small's modules (12 layers, same names and
    parameters) at width 16, for tests: the key count depends on the structure alone."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        small = dict(n_embd=16, n_head=2, vocab_size=128, n_positions=32) if tiny else {}
        model = GPT2LMHeadModel(GPT2Config(**small))
        batch = torch.randint(0, model.config.vocab_size, (1, 8))
        return model, lambda m: m(input_ids=batch, labels=batch).loss
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(4, 16)
    return model, lambda m: m(x).pow(2).mean()


def count(model, loss_fn, config: sw.Config) -> tuple[int, collections.Counter]:
    """(keys of the sampled step 0, keys per section)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() as d:
        mon = sw.watch(model, optimizer=opt, config=config.replace(sinks=("jsonl",)), run_dir=d)
        with mon.step(0):
            loss = loss_fn(model)
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()
        mon.close()
        with open(os.path.join(d, "stats.jsonl")) as f:
            records = [r for r in map(json.loads, f) if r["step"] == 0]
    dash = Dashboard.from_config(config)
    keys = []
    for r in records:
        keys += dash.values(r)[0]
        # stats.jsonl leaves the histograms out: every row with a finite nonzero value has one
        st = r["stats"]
        if dash.wants_histogram(r["module"], r["tensor"]) and st.get("finite", 0) > st.get("zeros", 0):
            keys.append(f"sw.{r['tensor']}.exponents/{r['module']}")
    return len(keys), collections.Counter(k.split("/", 1)[0] for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "mlp"])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--tiny", action="store_true", help="GPT-2's structure at width 16")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, loss_fn = build(args.model, args.tiny)
    n, sections = count(model, loss_fn, sw.Config.preset(args.preset))
    print("| model | preset | keys per sampled step | sections | largest section |")
    print("|---|---|---|---|---|")
    big = max(sections.values())
    print(f"| {args.model} | {args.preset} | {n} | {len(sections)} | {big} panels |")


if __name__ == "__main__":
    main()
