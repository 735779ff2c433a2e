"""The every-step sentinel tap: each step, before the optimizer step (its pre-step hook; without
an optimizer, at the step end), every watched parameter gradient goes to the sentinel in one
multi-tensor launch (stats/sentinel_store.py). On the first backward it also records, once, the
order in which the gradients became ready (post-accumulate-grad hooks), so that frames list
the sentinel in backward order; those hooks are removed as soon as the order is known.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .taps import _eager, param_role

log = logging.getLogger("stabilitywatch")


class SentinelTap:
    def __init__(self, params: list, store, active: Callable[[], bool],
                 local: Optional[Callable] = None, optimizer: bool = True):
        self.params = params                      # (module, pname, parameter), the taps' list
        self.store = store
        self.active = active                      # a step is open and the live model runs
        self.local = local or (lambda t, m, r: t)
        self.keys = [(name, param_role(pn, "grad")) for name, pn, _ in params]
        self._plain = [p for _, _, p in params]
        # the last full write saw plain tensors only (not DTensors, read through `local`)
        self._again = False
        store.set_keys(self.keys)
        self.handles: list = []
        # without an optimizer the sentinel runs when the last gradient of backward is ready
        self.optimizer = optimizer
        self._last_handle = None
        self._ready: list[int] = []
        self._seen: set[int] = set()
        self.written = False                      # this step's sentinel is written
        self.notified = False                     # after_write ran this step
        self.failed = False
        # after_write(optimizer or None, written): once per step on every rank, whatever the
        # gradients (the cross-rank flag is a collective), after the sentinel is written: in
        # the optimizer's pre-step hook, else at the step end
        self.after_write: list[Callable] = []
        # called from the optimizer's post-step hook with the optimizer
        self.after_step_fns: list[Callable] = []
        self.pacer = None   # pacing.Pacer: times the write

    # -- attach / detach -----------------------------------------------------------------------
    def attach(self) -> None:
        for k, (_, _, p) in enumerate(self.params):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._order_hook(k)))

    def detach(self) -> None:
        if self._last_handle is not None:
            self._last_handle.remove()
            self._last_handle = None
        self._remove_order_hooks()

    def _remove_order_hooks(self) -> None:
        while self.handles:
            h = self.handles.pop()
            try:
                h.remove()
            except Exception as e:
                log.warning("stabilitywatch: could not remove a hook (%s)", e)

    def _order_hook(self, k: int):
        def hook(p):
            if k not in self._seen:
                self._seen.add(k)
                self._ready.append(k)
        return _eager(hook)

    # -- per step ------------------------------------------------------------------------------
    def begin(self) -> None:
        self.written = self.notified = False

    def before_step(self, opt) -> None:
        """The optimizer's pre-step hook (the taps call it before their own gradient reads).
        With no gradient yet (a trainer whose step(closure) runs the backward inside step()),
        the write and the guard wait for the trainer's next call (Monitor.observe_grads), or
        for the step end."""
        if self.active() and not self.notified:
            if not self.written:
                self._write()
            if self.written:
                self._notify(opt)

    def after_step(self, opt) -> None:
        for fn in self.after_step_fns:
            fn(opt)

    def at_end(self) -> None:
        """Step end: the sentinel of a step whose optimizer step did not run inside it."""
        if self.active():
            if not self.written:
                self._write()
            if not self.notified:
                self._notify(None)
        self._freeze_order()

    def _last_ready(self, p) -> None:
        if self.active():
            self._write()

    def _notify(self, opt) -> None:
        self.notified = True
        for fn in self.after_write:
            fn(opt, self.written)

    def _write(self) -> None:
        if self.failed:
            return
        pacer = self.pacer
        if pacer is not None:   # its cost counts against the cost budget (pacing.py)
            pacer.sentinel_start()
        try:
            self._freeze_order()
            if self._again and self.store.write_again(self._plain):   # gradients not moved
                self.written = True
                return
            items = [(k, self.local(p.grad.detach(), *self.keys[k]))
                     for k, (_, _, p) in enumerate(self.params)
                     if p.grad is not None and p.grad.is_floating_point()]
            if not items:
                return
            self.store.write(items)
            self._again = all(type(p.grad) is torch.Tensor for p in self._plain)
            self.written = True
        except Exception as e:
            self.failed = True
            log.warning("stabilitywatch: the gradient sentinel failed (%s: %s); it is switched "
                        "off, training goes on", type(e).__name__, e)
        finally:
            if pacer is not None:
                pacer.sentinel_stop()

    def _freeze_order(self) -> None:
        if self.store.order is not None or not self._ready:
            return
        rest = [k for k in range(len(self.params)) if k not in self._seen]
        self.store.order = self._ready + rest
        self._remove_order_hooks()
        if not self.optimizer:
            p = self.params[self._ready[-1]][2]
            self._last_handle = p.register_post_accumulate_grad_hook(_eager(self._last_ready))
