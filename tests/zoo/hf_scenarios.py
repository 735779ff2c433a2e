"""The zoo on real architectures: HF transformers GPT-2 (Conv1D, LayerNorm, GELU) and Llama
(RMSNorm, SwiGLU, rotary), built from tiny configs with random init, trained on the CPU with the
default `Config()` (statistics every 10 steps after a 10-step warm-up), one fault each.

Each scenario returns an `HFRun`: every alert, the losses, the fault step and the expected first
incident (step, severity, root module, root role). A fault lands before the forward of its step
(weights written at step start are read at that step when it is sampled). The expected step is
the fault step for what the step's own statistics show, the first step after it for effects that
appear only once the optimizer has used the fault (the loss of the next step).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import (AttentionInterface, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM)

import stabilitywatch as sw  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 8


def sampled(step: int, every: int = 10, warmup: int = 10) -> bool:
    """Whether the default Config() reads every role at this step (no escalation)."""
    return step < warmup or step % every == 0


def first_read(step: int) -> int:
    """The first step at or after `step` that reads every role."""
    return next(s for s in range(step, step + 11) if sampled(s))


@dataclass
class HFRun:
    name: str
    arch: str
    fault_step: int
    expect: tuple   # (step or (first, last) step, severity, module, role) of the first loud root
    steps: int = 0
    alerts: list = field(default_factory=list)
    losses: list = field(default_factory=list)

    @property
    def roots(self) -> list:
        return [a for a in self.alerts if a.root]

    @property
    def loud_roots(self) -> list:
        return [a for a in self.roots if a.severity.value != "info"]

    @property
    def first(self):
        r = self.loud_roots
        return r[0] if r else None

    def got(self) -> tuple:
        a = self.first
        return None if a is None else (a.step, a.severity.value, a.module, a.tensor)


# -- attention scores through a LogitsTap: GPT-2's attention is a function, not a module -------
def _tapped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    s = module.scores(torch.matmul(query, key.transpose(-1, -2)) * scaling)
    if attention_mask is not None:
        s = (s.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
             else s + attention_mask)
    else:
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    w = F.dropout(torch.softmax(s, -1).type(value.dtype), p=dropout, training=module.training)
    return torch.matmul(w, value).transpose(1, 2), w


AttentionInterface.register("stabilitywatch_tapped", _tapped_attention)


def build(arch: str, seed: int = 0, tap_attention: bool = False):
    torch.manual_seed(seed)
    if arch == "gpt2":
        kw = {"attn_implementation": "stabilitywatch_tapped"} if tap_attention else {}
        m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                       n_positions=2 * SEQ, bos_token_id=0, eos_token_id=0, **kw))
        if tap_attention:
            for blk in m.transformer.h:
                blk.attn.scores = sw.LogitsTap("attention")   # q.k/sqrt(d), before the mask
        return m
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    raise ValueError(arch)


# module of each architecture that a scenario's fault targets
TARGET = {
    "gpt2": {"mlp_in": "transformer.h.1.mlp.c_fc", "mlp_out": "transformer.h.0.mlp.c_proj",
             "attn_out": "transformer.h.0.attn.c_proj"},
    "llama": {"mlp_in": "model.layers.1.mlp.up_proj", "mlp_out": "model.layers.0.mlp.down_proj",
              "attn_out": "model.layers.0.self_attn.o_proj"},
}


def lm_data(seed: int = 1):
    """A learnable synthetic language: next = (3 * prev + 1) mod VOCAB, 10% noise tokens."""
    def batch_at(step):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        s = [torch.randint(0, VOCAB, (BATCH, 1), generator=g)]
        for _ in range(SEQ):
            s.append((3 * s[-1] + 1) % VOCAB)
        s = torch.cat(s, 1)
        noise = torch.rand(s.shape, generator=g) < 0.1
        s = torch.where(noise, torch.randint(0, VOCAB, s.shape, generator=g), s)
        return s[:, :-1], s[:, 1:]
    return batch_at


def cosine(opt, base, steps, warm=50):
    def at(step):
        f = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        for g in opt.param_groups:
            g["lr"] = base * max(f, 0.05)
    return at


def train(model, opt, run_dir, steps, batch_at=None, config=None, before=None, stop_nan=True):
    batch_at = batch_at or lm_data()
    losses = []
    mon = sw.watch(model, opt, config=config or sw.Config(), run_dir=run_dir)
    with mon:
        for step in range(steps):
            if before:
                before(step)
            x, y = batch_at(step)
            with mon.step(step, batch=x):
                logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                mon.observe_loss(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))   # outside the monitored step
            if stop_nan and not math.isfinite(losses[-1]) and len(losses) > 1 \
                    and not math.isfinite(losses[-2]):
                break
    return mon.alerts, losses


def _run(name, arch, fault, expect, run_dir, steps, **kw) -> HFRun:
    model = kw.pop("model", None) or build(arch)
    opt = kw.pop("opt", None) or torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    setup = kw.pop("setup", None)
    before = setup(model, opt) if setup else None
    alerts, losses = train(model, opt, run_dir, steps, before=before, **kw)
    return HFRun(name, arch, fault, expect, len(losses), alerts, losses)


# -- the faults -----------------------------------------------------------------------------------
def weight_jump(run_dir, arch="gpt2", fault=20, steps=22) -> HFRun:
    """A weight multiplied by 1e4 at step start (a bad write): no optimizer moves it that far."""
    name = TARGET[arch]["mlp_in"]

    def setup(model, opt):
        mod = model.get_submodule(name)

        def before(step):
            if step == fault:
                with torch.no_grad():
                    mod.weight.mul_(1e4)
        return before
    return _run("weight x1e4", arch, fault, (first_read(fault), "critical", name, "weight"),
                run_dir, steps, setup=setup)


def bit_flip(run_dir, arch="gpt2", fault=20, steps=22) -> HFRun:
    """The top exponent bit of one fp32 weight element flipped (|x| < 2 becomes ~1e36-1e38)."""
    name = TARGET[arch]["mlp_out"]

    def setup(model, opt):
        mod = model.get_submodule(name)

        def before(step):
            if step == fault:
                with torch.no_grad():
                    mod.weight.view(-1).view(torch.int32)[5] ^= 1 << 30
        return before
    return _run("one exponent bit flipped in a weight", arch, fault,
                (first_read(fault), "critical", name, "weight"), run_dir, steps, setup=setup)


def backward_nan(run_dir, arch="gpt2", fault=20, steps=22) -> HFRun:
    """One NaN written into one module's output gradient (a hook); the forward stays finite."""
    name = TARGET[arch]["attn_out"]

    def setup(model, opt):
        state = {"on": False}

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
            return grad

        def hook(mod, args, out):
            if state["on"] and out.requires_grad:
                out.register_hook(poison)
        # registered before watch(): it runs first, so the monitor reads the poisoned gradient
        model.get_submodule(name).register_forward_hook(hook)

        def before(step):
            state["on"] = step == fault
        return before
    # on an unsampled step the every-step sentinel names the module's first parameter gradient
    # in backward order (its weight's or its bias's)
    role = "grad_output" if sampled(fault) else "grad*"
    return _run("NaN in one output gradient (backward only)", arch, fault,
                (fault, "critical", name, role), run_dir, steps, setup=setup)


def forward_inf(run_dir, arch="gpt2", fault=20, steps=22) -> HFRun:
    """One element of a module's output set to +Inf in the forward."""
    name = TARGET[arch]["mlp_in"]

    def setup(model, opt):
        state = {"on": False}

        def hook(mod, args, out):
            if state["on"]:
                out = out.clone()
                out.view(-1)[3] = float("inf")
                return out
        model.get_submodule(name).register_forward_hook(hook)

        def before(step):
            state["on"] = step == fault
        return before
    # on an unsampled step only the loss shows it: the sentinel says "the forward of step N"
    where = (name, "output") if sampled(fault) else ("", "loss")
    return _run("Inf in one forward output", arch, fault, (fault, "critical", *where),
                run_dir, steps, setup=setup)


def lr_blowup(run_dir, arch="gpt2", fault=20, steps=23) -> HFRun:
    """The learning rate x1000 from step `fault` on (a scheduler bug): the update of step
    `fault` wrecks the weights. On a sampled step the update-norm statistics (||dW|| / ||W||,
    read after the optimizer step) jump at once, the first module's update first; else the
    next step's loss spikes."""
    def setup(model, opt):
        def before(step):
            if step == fault:
                for g in opt.param_groups:
                    g["lr"] *= 1000.0
        return before
    expect = ((fault, "warning", "*", "optim.update") if sampled(fault) else
              (fault + 1, "warning", "", "loss"))
    return _run("learning rate x1000", arch, fault, expect, run_dir, steps, setup=setup)


def bad_batch(run_dir, arch="gpt2", fault=20, steps=21) -> HFRun:
    """One batch of uniform random tokens (a corrupt shard) in a learnt language."""
    data = lm_data()

    def batch_at(step):
        if step != fault:
            return data(step)
        g = torch.Generator().manual_seed(7)
        s = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return s[:, :-1], s[:, 1:]
    model = build(arch)   # a higher learning rate: the language is learnt by the fault step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return _run("a bad batch spikes the loss", arch, fault, (fault, "warning", "", "loss"),
                run_dir, steps, batch_at=batch_at, model=model, opt=opt)


def fp16_growth(run_dir, arch="gpt2", fault=20, steps=46) -> HFRun:
    """From step `fault` one MLP input projection's output grows x1.6 per step (judged as fp16,
    `formats={"output": "fp16"}`): it passes 65504 at step fault + 25."""
    name = TARGET[arch]["mlp_in"]

    def setup(model, opt):
        state = {"k": 0}

        def hook(mod, args, out):
            return out * 1.6 ** state["k"] if state["k"] else None
        model.get_submodule(name).register_forward_hook(hook)

        def before(step):
            state["k"] = max(0, step - fault)
        return before
    cfg = sw.Config(formats={"output": "fp16"})
    # the time-to-overflow forecast warns on a sampled step before the output passes 65504
    return _run("fp16 growth to overflow", arch, fault, ((fault, steps), "warning", name, "output"),
                run_dir, steps, setup=setup, config=cfg)


def attention_logit_growth(run_dir, arch="gpt2", fault=20, steps=31) -> HFRun:
    """GPT-2 with its attention scores tapped (`sw.LogitsTap("attention")` through a registered
    attention function). From step `fault` the query and key weights of the first block are
    pushed away from zero through their gradient (an anti-weight-decay term of the size of the
    gradient itself),
    so AdamW grows them by about lr per element per step: the attention logits grow
    quadratically (Wortsman et al. 2023), long before the loss diverges."""
    model = build(arch, tap_attention=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    name = "transformer.h.0.attn"

    def setup(model, opt):
        state = {"on": False}
        w = model.get_submodule(name).c_attn.weight     # Conv1D: [d, 3d], q and k first

        def push(grad):
            if not state["on"]:
                return grad
            grad = grad.clone()
            grad[:, :64] -= 2.0 * w.detach()[:, :64]
            return grad
        w.register_hook(push)

        def before(step):
            state["on"] = step >= fault
        return before
    return _run("attention-logit growth", arch, fault,
                ((fault, steps), "warning", name + ".scores", "attn_logits"), run_dir, steps,
                model=model, opt=opt, setup=setup)


def clean(run_dir, arch="gpt2", steps=1000) -> HFRun:
    """Warm-up and cosine decay, AdamW, dropout on (GPT-2): nothing may be loud."""
    model = build(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = cosine(opt, 3e-3, steps)
    return _run(f"clean run ({steps} steps)", arch, -1, None, run_dir, steps, model=model,
                opt=opt, setup=lambda m, o: sched)


FAULTS = {"weight_jump": weight_jump, "bit_flip": bit_flip, "backward_nan": backward_nan,
          "forward_inf": forward_inf, "lr_blowup": lr_blowup, "bad_batch": bad_batch,
          "fp16_growth": fp16_growth, "attention_logit_growth": attention_logit_growth}
