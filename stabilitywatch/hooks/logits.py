"""Opt-in taps for the instabilities of Wortsman et al. 2023 (arXiv 2309.14322): attention-logit
growth and output-logit divergence.

A model shows the monitor where its logits are in one of two ways:
- `LogitsTap("attention")` / `LogitsTap("output")`: an identity module placed where the scores
  flow (attention: q.k/sqrt(d) before masking and softmax; output: the LM head's logits);
- `Config(attn_logits=("blocks.*.attn.scores",), output_logits=("head",))`: modules whose output
  is read as such (for models you cannot edit).
On sampled steps (role `output` on) they give the rows `attn_logits` (max |logit| is the row's
absmax; -inf from masking is read as 0) and, for output logits, `logits` and `logz`
(logsumexp over the last dimension, in fp32: one extra pass over the logits).
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Callable

import torch
import torch.nn as nn

from ..config import Config, Role
from ..stats.buffer import Phase
from .tensors import float_tensors

log = logging.getLogger("stabilitywatch")
KINDS = ("attention", "output")


class LogitsTap(nn.Identity):
    """Identity that marks attention scores (`kind="attention"`) or output logits
    (`kind="output"`) for the spike detector. Costs nothing when no monitor is attached."""

    def __init__(self, kind: str = "attention"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"LogitsTap kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


def logit_modules(model: nn.Module, config: Config) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) for every LogitsTap and every module matching the Config globs."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, LogitsTap):
            out.append((name, mod, mod.kind))
        elif any(fnmatch.fnmatchcase(name, p) for p in config.attn_logits):
            out.append((name, mod, "attention"))
        elif any(fnmatch.fnmatchcase(name, p) for p in config.output_logits):
            out.append((name, mod, "output"))
    for field in ("attn_logits", "output_logits"):
        for p in getattr(config, field):
            if not any(fnmatch.fnmatchcase(n, p) for n, _ in model.named_modules()):
                raise ValueError(f"stabilitywatch: Config.{field} pattern {p!r} matches no module")
    return out


class LogitTaps:
    def __init__(self, targets: list[tuple[str, nn.Module, str]], record: Callable,
                 is_on: Callable[[Role], bool]):
        self.targets, self.record, self.is_on = targets, record, is_on
        self.handles: list = []
        self.failed: set[str] = set()

    def attach(self) -> None:
        for name, mod, kind in self.targets:
            self.handles.append(mod.register_forward_hook(self._hook(name, kind)))

    def detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    def _hook(self, name: str, kind: str):
        def hook(mod, args, output):
            if name in self.failed or not self.is_on(Role.OUTPUT):
                return None
            try:
                for _, t in list(float_tensors(output))[:1]:
                    self._read(name, kind, t.detach())
            except Exception as e:
                self.failed.add(name)
                log.warning("stabilitywatch: logits tap of %r failed (%s: %s); switched off",
                            name, type(e).__name__, e)
            return None
        return hook

    def _read(self, name: str, kind: str, t: torch.Tensor) -> None:
        if kind == "attention":
            # masked positions (-inf) are not logits; NaN and +inf still count
            self.record(t.masked_fill(t == float("-inf"), 0), name, "attn_logits",
                        Phase.FORWARD, False)
            return
        self.record(t, name, "logits", Phase.FORWARD, False)
        if t.dim() >= 1 and t.shape[-1] > 0:
            self.record(torch.logsumexp(t.float(), dim=-1), name, "logz", Phase.FORWARD, False)
