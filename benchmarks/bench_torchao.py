"""Step-time cost of watching a torchao float8 model at its casts, same run, interleaved:

    python benchmarks/bench_torchao.py --repeats 3   # GPU: HF Llama from a config (8 layers,
                                                     # d 1024, vocab 32000), batch 8 x 1024, bf16,
                                                     # torchao float8 (tensorwise, current
                                                     # scaling), torch.compile, fused AdamW
    python benchmarks/bench_torchao.py --smoke       # CPU: tiny shapes, torchao's emulation

Configurations: no monitor; `sw.watch` with the default Config (module rows only, the float8
casts unseen); `watch_float8` with the default Config (module rows and the three casts of
every Float8Linear, on the sampled steps: every 10th); `watch_float8` reading every step. The
output layer stays in bf16 (torchao's usual filter). ms/step is the mean over the timed window
(one sync at its end), so sampled steps count at their full cost; the table gives the median
round and the range of each round's ratio to the same round's baseline.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import torch

import stabilitywatch as sw
from stabilitywatch.integrations.torchao import watch_float8

KINDS = ["no monitor", "watch (default)", "watch_float8 (default)", "watch_float8, every step"]


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(vocab=256, dim=64, ffn=128, layers=2, heads=4, seq=32, batch=2, steps=3,
                    warm=2)
    # the window (steps 15..44) holds three sampled steps of the default config (20, 30, 40)
    return dict(vocab=32000, dim=1024, ffn=2816, layers=8, heads=16, seq=1024, batch=8,
                steps=30, warm=15)


def build(s: dict, device: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["heads"], max_position_embeddings=s["seq"])
    model = LlamaForCausalLM(cfg).to(device)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device != "cuda"),
                               module_filter_fn=lambda mod, name: name != "lm_head")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    return model, opt, {"input_ids": ids, "labels": ids}


def run(kind: str, s: dict, device: str, out: str, compile_: bool) -> float:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model, opt, batch = build(s, device)
    step_model = torch.compile(model) if compile_ else model
    mon = None
    if kind == "watch (default)":
        mon = sw.watch(model, opt, config=sw.Config(sinks=("jsonl",)), run_dir=out)
    elif kind == "watch_float8 (default)":
        mon = watch_float8(model, opt, config=sw.Config(sinks=("jsonl",)), run_dir=out)
    elif kind == "watch_float8, every step":
        mon = watch_float8(model, opt, config=sw.Config(every=1, sinks=("jsonl",)), run_dir=out)
    t0 = 0.0
    for step in range(s["warm"] + s["steps"]):
        if step == s["warm"]:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        if mon is not None:
            mon.begin_step(step, batch=batch)
        loss = step_model(**batch).loss
        loss.backward()
        if mon is not None:
            mon.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.end_step()
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / s["steps"]
    if mon is not None:
        mon.close()
    return ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="eager float8 (default: compiled)")
    p.add_argument("--configs", default=";".join(KINDS),
                   help=f"separated by ;, from: {'; '.join(KINDS)}")
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.configs.split(";")]
    if "no monitor" not in kinds or any(k not in KINDS for k in kinds):
        p.error(f"--configs: choose from {KINDS}, including 'no monitor' (the baseline)")
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    s = shapes(a.smoke or device == "cpu")
    compile_ = not a.no_compile and device == "cuda"
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(max(1, a.repeats)):
            rounds.append({k: run(k, s, device, f"{tmp}/{r}-{i}", compile_)
                           for i, k in enumerate(kinds)})
    ratio = {k: sorted(rd[k] / rd["no monitor"] for rd in rounds) for k in kinds}
    med = {k: sorted(rd[k] for rd in rounds)[len(rounds) // 2] for k in kinds}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    import torchao
    print(f"# bench_torchao on {name}, torch {torch.__version__}, torchao {torchao.__version__}, "
          f"{'compiled' if compile_ else 'eager'}: {s}; {len(rounds)} round(s)")
    print("| configuration | ms/step | ratio (median round) | ratio range |")
    print("|---|---:|---:|---|")
    for k in kinds:
        r = ratio[k]
        print(f"| {k} | {med[k]:.2f} | {r[len(r) // 2]:.3f}x | {r[0]:.3f} .. {r[-1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
