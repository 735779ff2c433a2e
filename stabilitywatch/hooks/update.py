"""The optimizer's update as a tensor role: on sampled steps that read weights, the watched
parameters are copied in the optimizer's pre-step hook and, in its post-step hook, the copies
become dW = W_after - W_before (in place), read as rows of role `optim.update`
(`optim.update.<name>` for a parameter other than `weight`; an `optim.*` role, it comes after the
gradients in dataflow order and the drift detector leaves it alone by default, as it does Adam's
moments), from which detectors/update.py derives ||dW|| / ||W|| per module.

Exact for any optimizer (it is the applied update, whatever the optimizer computes), no host
sync, and the extra memory is one copy of the watched parameters that the optimizer updates,
held from the pre-step hook to the post-step hook of sampled steps only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import Role
from ..stats.buffer import Phase
from .taps import param_role


class UpdateTap:
    def __init__(self, params: list, record_many: Callable, is_on: Callable,
                 local: Optional[Callable] = None):
        self.params = params                   # (module, pname, parameter)
        self.record_many = record_many
        self.is_on = is_on
        self.local = local or (lambda t, m, r: t)
        self.roles = [param_role(pn, "optim.update") for _, pn, _ in params]
        self._before: Optional[list] = None

    def before(self, opt) -> None:
        self._before = None
        if not self.is_on(Role.WEIGHT):
            return
        keep = [k for k, (_, _, p) in enumerate(self.params)
                if p.grad is not None and p.is_floating_point()]
        if not keep:
            return
        ws = self._weights(keep)
        # -W_before, in float32 (float64 kept): dW is ~1e-3 of W, a bf16 difference would
        # round it away. One multi-tensor launch for float32 parameters.
        if all(w.dtype == torch.float32 for w in ws):
            neg = list(torch._foreach_mul(ws, -1.0))
        else:
            neg = [w.to(torch.float64 if w.dtype == torch.float64 else torch.float32).neg()
                   for w in ws]
        self._before = (keep, neg)

    def _weights(self, keep: list) -> list:
        params, roles, local, plain = self.params, self.roles, self.local, torch.Tensor
        ws = [params[k][2].detach() for k in keep]
        # a subclass may be a DTensor: its local shard
        return [w if type(w) is plain else local(w, params[k][0], roles[k])
                for k, w in zip(keep, ws)]

    def after(self, opt) -> None:
        if self._before is None:
            return
        keep, neg = self._before
        self._before = None
        torch._foreach_add_(neg, self._weights(keep))   # W_after - W_before = dW
        params, roles = self.params, self.roles
        items = [(c, params[k][0], roles[k]) for k, c in zip(keep, neg)]
        # overwrite=False: the buffer keeps one launch plan per (phase, overwrite), and the
        # optimizer-state taps hold (OPTIM, True) in the same hook; a shared key would rebuild
        # both plans every sampled step
        self.record_many(items, Phase.OPTIM, False)
