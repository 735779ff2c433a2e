"""Shadow replicas: re-run selected modules in fp32/fp64 on the live inputs, teacher-forced.

On shadow steps a forward hook calls `torch.func.functional_call(module, upcast parameters,
upcast inputs)` under `torch.no_grad()` with autocast off. The replica *is* the live module with
its parameters swapped for upcast views for the duration of the call: it follows the live
(master) weights with no copy when they are already fp32, and makes a transient upcast copy when
they are bf16/fp16 ("refreshed when used"). Buffers are passed as copies, so a BatchNorm's running
statistics are not updated twice. The RNG state the live call started from is replayed for the
shadow call (same dropout masks) and the state the live call left is restored afterwards: the live
RNG stream, weights and autograd graph are untouched, and only the runner's own forward hooks run
inside the replica (the user's hooks and the monitor's taps never see shadow tensors).

The errors are not computed on the host: each shadow call records statistics rows through the
monitor's buffer - `shadow.output` (the replica's output), `shadow.error` (live - shadow) and
`shadow.ulp` (|live - shadow| in units in the last place of the live dtype) - and the host derives
relative L2 error, SQNR, cosine, max abs and max ULP error from them (shadow/metrics.py).
With `shadow.model`, a hook on the root module re-runs the whole model the same way; the shadowed
modules then also get `shadow.model.*` rows: the error accumulated up to each of them.
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from ..config import Config, Role
from ..hooks.tensors import float_tensors
from ..stats.buffer import Phase

log = logging.getLogger("stabilitywatch")


def shadow_targets(model: nn.Module, config: Config,
                   watched: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules that get a replica: `shadow.modules` globs, else the watched modules."""
    if not config.shadow.modules:
        return [(n, m) for n, m in watched if n != ""]
    hits = {p: 0 for p in config.shadow.modules}
    out = []
    for name, mod in model.named_modules():
        for p in config.shadow.modules:
            if fnmatch.fnmatchcase(name, p):
                hits[p] += 1
                if not out or out[-1][0] != name:
                    out.append((name, mod))
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        raise ValueError(f"stabilitywatch: Config.shadow.modules pattern(s) {missing} match no "
                         f"module of the model")
    return out


def ulp_of(ref: torch.Tensor, live_dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `live_dtype` at the magnitude of `ref` (a tensor in the
    shadow dtype): 2**(floor(log2|ref|) - mantissa bits), never below the smallest subnormal."""
    fi = torch.finfo(live_dtype)
    emin = math.frexp(fi.tiny)[1] - 1  # exponent of the smallest normal, on the host
    mant = round(-math.log2(fi.eps))     # stored mantissa bits (eps = 2**-mant)
    _, e = torch.frexp(ref)
    exp = torch.where(ref == 0, torch.full_like(e, emin), e - 1).clamp_(min=emin)
    return torch.exp2((exp - mant).to(ref.dtype))


class ShadowRunner:
    """Forward hooks for shadow replicas. `record(t, module, role, phase, overwrite)` is the
    monitor's; `begin_step`/`end_step` frame each step; `running` is True while a replica runs
    (the monitor's own taps stay quiet then)."""

    def __init__(self, model: nn.Module, config: Config, targets: list[tuple[str, nn.Module]],
                 record: Callable, watched: set[str]):
        self.model, self.config, self.targets = model, config, targets
        self.record, self.watched = record, watched
        self.dtype = torch.float64 if config.shadow.dtype == "fp64" else torch.float32
        self.every = config.shadow_every
        self.running = False
        self.active = False
        self._outputs_on = False
        self._sampled = 0
        self._replay = False
        self._rng: dict[str, tuple] = {}
        self._stash: dict[str, list] = {}
        self.handles: list = []
        self.failed: set[str] = set()

    # -- attach / schedule ----------------------------------------------------------------
    def attach(self) -> None:
        for name, mod in self.targets:
            self.handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._post(name, mod), with_kwargs=True))
        if self.config.shadow.model:
            self.handles.append(self.model.register_forward_pre_hook(self._pre(""),
                                                                     with_kwargs=True))
            self.handles.append(self.model.register_forward_hook(self._root_post,
                                                                 with_kwargs=True))

    def detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()
        self.end_step()

    def begin_step(self, on: frozenset) -> None:
        """Shadow steps: every `shadow_every`-th sampled step (one reading more than the loss)."""
        sampled = any(r is not Role.LOSS for r in on)
        self.active = bool(self.every) and sampled and self._sampled % self.every == 0
        self._sampled += int(sampled)
        self._outputs_on = Role.OUTPUT in on

    def end_step(self) -> None:
        # no tensor outlives the step
        self.active = False
        self._rng.clear()
        self._stash.clear()

    # -- hooks ----------------------------------------------------------------------------
    def _pre(self, name: str):
        def hook(mod, args, kwargs):
            if self.active and not self.running:
                self._rng[name] = _rng_state(args, kwargs)
            return None
        return hook

    def _post(self, name: str, mod: nn.Module):
        def hook(m, args, kwargs, output):
            if not self.active:
                return None
            if self.running:
                if self._replay and self._stash.get(name):
                    live = self._stash[name].pop(0)
                    self._guard(name, self._compare, name, live, output, "shadow.model")
                return None
            if self.config.shadow.model:
                self._stash.setdefault(name, []).append(
                    [(sfx, t.detach()) for sfx, t in float_tensors(output)])
            self._guard(name, self._local, name, mod, args, kwargs, output)
            return None
        return hook

    def _root_post(self, model, args, kwargs, output):
        if not self.active or self.running:
            return None
        self._guard("<model>", self._whole, model, args, kwargs, output)
        return None

    # -- the replica runs -------------------------------------------------------------------
    def _local(self, name, mod, args, kwargs, output) -> None:
        with self._isolated(self._rng.pop(name, None), args, kwargs), self._own_hooks_only(mod):
            shadow = functional_call(mod, self._state(mod), self._up(args), self._up(kwargs))
        self._compare(name, float_tensors(output), shadow, "shadow")

    def _whole(self, model, args, kwargs, output) -> None:
        with self._isolated(self._rng.pop("", None), args, kwargs), self._own_hooks_only(model):
            self._replay = True
            try:
                shadow = functional_call(model, self._state(model), self._up(args),
                                         self._up(kwargs))
            finally:
                self._replay = False
        self._compare("", float_tensors(output), shadow, "shadow.model")

    def _compare(self, name: str, live_pairs, shadow, kind: str) -> None:
        live = dict(live_pairs)
        for sfx, s in float_tensors(shadow):
            y = live.get(sfx)
            if y is None or y.shape != s.shape or y.numel() == 0:
                continue
            y, s = y.detach(), s.detach().to(self.dtype)
            err = y.to(self.dtype) - s
            self.record(s, name, f"{kind}.output{sfx}", Phase.FORWARD, False)
            self.record(err, name, f"{kind}.error{sfx}", Phase.FORWARD, False)
            self.record(err.abs_() / ulp_of(s, y.dtype), name, f"{kind}.ulp{sfx}",
                        Phase.FORWARD, False)
            if not (self._outputs_on and name in self.watched) and (kind == "shadow" or not name):
                # the live row for the cosine; watched modules already have their `output` row
                self.record(y, name, f"shadow.live{sfx}", Phase.FORWARD, False)

    def _state(self, mod: nn.Module) -> dict:
        st = {k: p.detach().to(self.dtype) for k, p in mod.named_parameters()}
        for k, b in mod.named_buffers():
            st[k] = b.detach().to(self.dtype if b.is_floating_point() else b.dtype, copy=True)
        return st

    def _up(self, tree):
        return tree_map(lambda t: t.detach().to(self.dtype)
                        if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

    @contextlib.contextmanager
    def _isolated(self, rng_before, args, kwargs):
        after = _rng_state(args, kwargs)
        self.running = True
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                for dev in ("cpu", "cuda"):
                    if dev == "cpu" or torch.cuda.is_available():
                        stack.enter_context(torch.autocast(device_type=dev, enabled=False))
                if rng_before is not None:
                    _set_rng(rng_before)
                yield
        finally:
            _set_rng(after)
            self.running = False

    @contextlib.contextmanager
    def _own_hooks_only(self, root: nn.Module):
        """Inside the replica only the runner's own forward hooks run: the user's hooks and the
        monitor's taps never see shadow tensors (the dicts are swapped back in `finally`)."""
        keep = {h.id for h in self.handles}
        saved = [(m, m._forward_hooks, m._forward_pre_hooks) for m in root.modules()]
        for m, post, pre in saved:
            m._forward_hooks = OrderedDict((k, v) for k, v in post.items() if k in keep)
            m._forward_pre_hooks = OrderedDict((k, v) for k, v in pre.items() if k in keep)
        try:
            yield
        finally:
            for m, post, pre in saved:
                m._forward_hooks, m._forward_pre_hooks = post, pre

    def _guard(self, where: str, fn, *args) -> None:
        if where in self.failed:
            return
        try:
            fn(*args)
        except Exception as e:
            self.failed.add(where)
            log.warning("stabilitywatch: the shadow replica of %s failed (%s: %s); it is "
                        "switched off, training goes on", where or "<model>", type(e).__name__, e)


def _rng_state(args, kwargs) -> tuple:
    """CPU generator state and that of every CUDA device the inputs live on (host-side Philox
    seed/offset: reading it does not wait for the GPU)."""
    devs = sorted({t.device.index or 0 for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devs]


def _set_rng(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)
