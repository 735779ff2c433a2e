"""Hooks that feed tensors to the statistics buffer: module outputs/inputs (forward hooks),
gradients of outputs (tensor hooks registered in the forward hook), parameters, parameter
gradients after accumulation, and optimizer state after optimizer.step().

Every hook body is guarded: an exception switches that tap off with one warning and training
goes on. All handles are kept and removed by `detach()`; no tensor is kept beyond the call. In
eager mode the forward hooks are registered only while steps read a forward role (`set_forward`,
at each step start); on a compiled model they stay registered.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..config import Role
from ..stats.buffer import Phase
from .tensors import float_tensors

log = logging.getLogger("stabilitywatch")



def _eager(fn):
    """Run a hook eagerly even inside a torch.compile'd model: the hook's host bookkeeping is
    not traceable, so dynamo breaks the graph around it instead of failing."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn) if disable is not None else fn


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def assume_constant(fn):
    """torch.compiler.assume_constant_result(fn), which only sets this attribute; calling it at a
    class definition would import torch._dynamo (~1 s) with the package.
    tests/test_import_cost.py checks that the two mark a function alike."""
    fn._dynamo_marked_constant = True
    return fn


def _compiling() -> bool:
    return bool(_is_compiling())


def compiled_model(model: nn.Module) -> bool:
    """True for a torch.compile wrapper, or a model with a module compiled in place
    (`Module.compile()`)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:   # a torch without dynamo
        return False
    return isinstance(model, OptimizedModule) or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


FORWARD_ROLES = frozenset({Role.OUTPUT, Role.INPUT, Role.GRAD_OUTPUT})


def _eager_when_compiling(fn):
    """fn, entered through its _eager wrapper only while dynamo traces the call (compiled
    autograd traces tensor hooks): outside tracing the wrapper's several us per call buy
    nothing."""
    wrapped = _eager(fn)

    def call(*args):
        if _compiling():
            return wrapped(*args)
        return fn(*args)
    return call


# Taps.traced_on on a step whose forward hooks take the eager path even when compiled
EAGER = "eager"

# record(tensor, module, role, phase, overwrite) and is_on(role) come from the Monitor
Record = Callable[[torch.Tensor, str, str, int, bool], None]
IsOn = Callable[[Role], bool]


def param_role(pname: str, kind: str) -> str:
    """Role of a parameter's tensors: weight/grad/optim.<state> for a `weight` parameter,
    <name>/grad.<name>/optim.<state>.<name> for any other (bias, ...)."""
    if pname == "weight":
        return {"weight": "weight", "grad": "grad"}.get(kind, kind)
    return {"weight": pname, "grad": f"grad.{pname}"}.get(kind, f"{kind}.{pname}")


def _grad_tap(traced):
    """An identity whose backward records the output gradient: how compiled graphs read it.
    A gradient hook registered in traced code takes torch 2.13 through a speculation that loses
    the model's own pending attribute writes (HF's KV cache: the model then falls back to
    eager frame by frame)."""
    class GradTap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, name, role):
            ctx.name, ctx.role = name, role
            # a copy, not a view: the model may write its output in place (ReLU(inplace=True)),
            # which autograd forbids on a custom Function's view; inductor removes the copy
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            traced(grad.detach(), ctx.name, ctx.role, Phase.BACKWARD)
            return grad, None, None
    return GradTap


def planned_rows(modules: list[tuple[str, nn.Module]]) -> int:
    """The rows a sampled step of the default roles writes, as the buffer's first capacity:
    per watched module its output and output gradient, per parameter its weight, gradient,
    update and two optimizer states (Adam's), and a few rows of the model's own (loss, batch).
    Rows that grow replace the rows tensor, a recompile for compiled code (a graph is guarded
    on its shape) and, while dynamo traces, no growth at all (Monitor._traced_slot)."""
    n = sum(2 + 5 * sum(1 for _ in mod.parameters(recurse=False)) for _, mod in modules)
    return max(16, n + 16)


class Taps:
    def __init__(self, modules: list[tuple[str, nn.Module]], optimizer: Optional[torch.optim.Optimizer],
                 record: Record, is_on: IsOn, traced: Optional[Callable] = None,
                 record_many: Optional[Callable] = None):
        self.modules = modules
        self.optimizer = optimizer
        self.record = record
        # record_many(items, phase, overwrite), items (tensor, module, role): the taps over every
        # parameter at once (weights, gradients, optimizer state), which it may batch
        self.record_many = record_many or (
            lambda items, phase, overwrite: [record(t, m, r, phase, overwrite) for t, m, r in items])
        self.is_on = is_on
        # traced(tensor, module, role, phase): the path taken while torch.compile traces a hook
        self.traced = traced
        # what a compiled forward hook reads this step (begin_step): the only state of the
        # monitor that compiled code is guarded on
        self.traced_on: "tuple[bool, bool] | str | None" = None
        self._grad_tap = _grad_tap(traced) if traced is not None else None
        # True once torch.compile has traced one of these hooks into a graph: the graphs are
        # guarded on the forward hooks, so they stay registered on every step from then on
        self.compiled = False
        self.handles: list = []
        self._failed: set[str] = set()
        # the forward hooks, made once; in eager mode they are registered only for steps that
        # read a forward role (set_forward): a module with a forward hook, even one that returns
        # at once, leaves nn.Module's fast call path (~3-5 us per module call)
        self._forward = [(mod, self._forward_hook(name)) for name, mod in modules]
        self._forward_handles: list = []
        self._before: list[set] = []          # per module: its hook ids at attach time
        # set once compiled code may have traced the hooks: they then stay registered (adding
        # and removing them would change what dynamo guards on, a recompile each time)
        self.keep_forward = False
        # the every-step gradient sentinel (hooks/sentinel.py), set by the Monitor
        self.sentinel = None
        # the optimizer's update dW on sampled steps (hooks/update.py), set by the Monitor
        self.update = None
        # (module, role) -> its gradient hook, made once: wrapping a function for eager running
        # (torch._dynamo.disable) costs ~0.3-0.6 ms of host time, and the forward hook registers
        # one gradient hook per output on every sampled step
        self._grad_output_hooks: dict[tuple[str, str], Callable] = {}
        # parameters of the watched modules, each once (shared/tied weights keep their first owner)
        self.params: list[tuple[str, str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, mod in modules:
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((name, pname, p))
        # each parameter's weight and grad roles, made once (the taps run every sampled step)
        self._roles = ([param_role(pn, "weight") for _, pn, _ in self.params],
                       [param_role(pn, "grad") for _, pn, _ in self.params])
        self._optim_roles: dict[tuple[str, str], str] = {}   # (pname, state name) -> role

    # -- attach / detach -------------------------------------------------------------------
    def attach(self) -> None:
        try:
            if self.sentinel is not None:
                self.sentinel.attach()
            self._before = [set(mod._forward_hooks) for mod, _ in self._forward]
            self._attach_forward()
            if self.optimizer is not None:
                self.handles.append(self.optimizer.register_step_pre_hook(self._grads_before_step))
                self.handles.append(self.optimizer.register_step_post_hook(self._optim_state))
            else:
                for name, pname, p in self.params:
                    if p.requires_grad:
                        self.handles.append(
                            p.register_post_accumulate_grad_hook(self._grad_hook(name, pname)))
        except Exception:
            self.detach()
            raise

    def detach(self) -> None:
        if self.sentinel is not None:
            self.sentinel.detach()
        self._detach_forward()
        while self.handles:
            h = self.handles.pop()
            try:
                h.remove()
            except Exception as e:  # never let cleanup hide the user's own exception
                log.warning("stabilitywatch: could not remove a hook (%s)", e)

    def set_forward(self, reads: bool) -> None:
        """At a step start: the forward hooks registered when the step reads a forward role
        (or compiled code may run them: a compiled model's graphs are guarded on its hooks, so
        once dynamo has traced them they stay), removed otherwise. Never raises: a failure keeps
        the hooks as they are, with one warning."""
        want = reads or self.keep_forward or self.compiled
        if want == bool(self._forward_handles):
            return
        try:
            if want:
                self._attach_forward()
            else:
                self._detach_forward()
        except Exception as e:
            self.keep_forward = True
            log.warning("stabilitywatch: re-registering the forward hooks failed (%s: %s); they "
                        "stay as they are", type(e).__name__, e)

    def _attach_forward(self) -> None:
        for (mod, fn), before in zip(self._forward, self._before):
            h = mod.register_forward_hook(fn)
            self._forward_handles.append(h)
            hooks = mod._forward_hooks
            if len(hooks) > len(before) + 1:
                # hooks the user registered after watch() keep running after the monitor's
                for k in [k for k in hooks if k not in before and k != h.id]:
                    hooks.move_to_end(k)

    def _detach_forward(self) -> None:
        while self._forward_handles:
            h = self._forward_handles.pop()
            try:
                h.remove()
            except Exception as e:
                log.warning("stabilitywatch: could not remove a hook (%s)", e)

    # -- guarded execution -----------------------------------------------------------------
    def _guard(self, where: str, fn, *args) -> None:
        if where in self._failed:
            return
        try:
            fn(*args)
        except Exception as e:
            self._fail(where, e)

    def _fail(self, where: str, e: Exception) -> None:
        self._failed.add(where)
        log.warning("stabilitywatch: %s failed (%s: %s); that tap is switched off, "
                    "training goes on", where, type(e).__name__, e)

    # -- the taps --------------------------------------------------------------------------
    def weights(self) -> None:
        """Parameters as the step's forward will see them (called at step start)."""
        if not self.is_on(Role.WEIGHT):
            return
        items = [(p.detach(), name, role) for (name, _, p), role in zip(self.params, self._roles[0])]
        self._guard("weight taps", self.record_many, items, Phase.WEIGHT, False)

    def _forward_hook(self, name: str):
        where = f"forward hook of {name!r}"

        def eager(mod, args, output):
            want_out, want_in = self.is_on(Role.OUTPUT), self.is_on(Role.INPUT)
            want_grad = self.is_on(Role.GRAD_OUTPUT) and torch.is_grad_enabled()
            if not (want_out or want_in or want_grad):
                return None
            self._guard(where, self._on_forward, name, args, output, want_out, want_in,
                        want_grad)
            return None
        eager = _eager(eager)

        def hook(mod, args, output):
            if _compiling():
                on = self.traced_on   # the compiled graph's one guard of the monitor's state
                if on is None:
                    return None
                if on is not EAGER:
                    return self._traced_forward(name, output, *on)
                return eager(mod, args, output)   # dynamo breaks the graph around it
            # run eagerly: no wrapper to enter (torch._dynamo.disable's costs a few us a call);
            # most steps read nothing in the forward and return here
            is_on = self.is_on
            want_out, want_in = is_on(Role.OUTPUT), is_on(Role.INPUT)
            want_grad = is_on(Role.GRAD_OUTPUT) and torch.is_grad_enabled()
            if not (want_out or want_in or want_grad) or where in self._failed:
                return None
            try:
                self._on_forward(name, args, output, want_out, want_in, want_grad)
            except Exception as e:
                self._fail(where, e)
            return None
        return hook

    def begin_step(self, on: frozenset) -> None:
        """What compiled forwards read this step (`on`: the step's roles; empty between steps):
        one value per kind of step, so that a compiled model has a graph for the steps that
        read nothing in the forward and one for those that do, and no guard on the step."""
        want = (Role.OUTPUT in on, Role.GRAD_OUTPUT in on)
        if Role.INPUT in on or self.traced is None:
            # a module's inputs are read by the eager hook (one graph break per module)
            self.traced_on = EAGER if (any(want) or Role.INPUT in on) else None
        else:
            self.traced_on = want if any(want) else None

    def _traced_forward(self, name: str, output, want_out: bool, want_grad: bool) -> None:
        """Inside torch.compile: records become custom-op calls in the graph (no break)."""
        want_grad = want_grad and torch.is_grad_enabled()
        if want_grad and isinstance(output, torch.Tensor) and output.requires_grad \
                and output.is_floating_point():
            if want_out:
                self.traced(output.detach(), name, "output", Phase.FORWARD)
            return self._grad_tap.apply(output, name, "grad_output")
        for suffix, t in float_tensors(output):
            if want_out:
                self.traced(t.detach(), name, "output" + suffix, Phase.FORWARD)
            if want_grad and t.requires_grad:
                t.register_hook(self._traced_grad_hook(name, "grad_output" + suffix))
        return None

    def _traced_grad_hook(self, name: str, role: str):
        def hook(grad):
            if grad is not None:
                self.traced(grad.detach(), name, role, Phase.BACKWARD)
            return None
        return hook

    def _on_forward(self, name, args, output, want_out, want_in, want_grad) -> None:
        if want_in:
            inputs = list(float_tensors(args))
            for suffix, t in inputs:
                role = "input" if len(inputs) == 1 else "input" + suffix
                self.record(t.detach(), name, role, Phase.FORWARD, False)
        if type(output) is torch.Tensor:   # most modules: no walk through a structure
            found = ((("", output),) if output.is_floating_point() and not output.is_complex()
                     else ())
        else:
            found = float_tensors(output)
        for suffix, t in found:
            if want_out:
                self.record(t.detach(), name, "output" + suffix, Phase.FORWARD, False)
            if want_grad and t.requires_grad:
                t.register_hook(self._grad_output_hook(name, "grad_output" + suffix))

    def _grad_output_hook(self, name: str, role: str):
        hook = self._grad_output_hooks.get((name, role))
        if hook is None:
            hook = self._grad_output_hooks[(name, role)] = self._make_grad_output_hook(name, role)
        return hook

    def _make_grad_output_hook(self, name: str, role: str):
        where = f"backward hook of {name!r}"

        def body(grad):
            if grad is not None and where not in self._failed:
                try:
                    self.record(grad.detach(), name, role, Phase.BACKWARD, False)
                except Exception as e:
                    self._fail(where, e)
            return None
        return _eager_when_compiling(body)

    def _grad_hook(self, name: str, pname: str):
        role = param_role(pname, "grad")
        where = f"gradient tap of {name}.{pname}"

        def hook(p):
            if self.is_on(Role.GRAD) and p.grad is not None:
                # overwrite: the row shows the gradient as accumulated so far, not a sum of sums
                self._guard(where, self.record, p.grad.detach(), name, role, Phase.GRAD, True)
        return _eager_when_compiling(hook)

    def _grads_before_step(self, opt, args, kwargs):
        if self.update is not None:
            self._guard("update taps", self.update.before, opt)
        # torch passes step()'s own positional arguments, the optimizer first
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.read_grads(opt)
        # else step(closure) runs the backward after this hook (Lightning, LBFGS): the gradients
        # here are the last step's; Monitor.observe_grads (the trainer integrations) or the
        # step end reads this step's
        return None

    def read_grads(self, opt) -> None:
        """The sentinel and the gradient rows: from the optimizer's pre-step hook, and again from
        Monitor.observe_grads for trainers whose step(closure) runs the backward after it."""
        if self.sentinel is not None:
            self.sentinel.before_step(opt)
        if not self.is_on(Role.GRAD):
            return
        items = [(p.grad.detach(), name, role) for (name, _, p), role
                 in zip(self.params, self._roles[1]) if p.grad is not None]
        self._guard("gradient taps", self.record_many, items, Phase.GRAD, True)

    def _optim_state(self, opt, args, kwargs):
        if self.sentinel is not None:
            self.sentinel.after_step(opt)
        if self.update is not None:
            self._guard("update taps", self.update.after, opt)
        if not self.is_on(Role.OPTIM):
            return None
        items = []
        get, roles, tensor = opt.state.get, self._optim_roles, torch.Tensor
        for name, pname, p in self.params:
            state = get(p)
            if not state:
                continue
            n = p.numel()
            for k, v in state.items():
                # per-element state only (exp_avg, exp_avg_sq, momentum_buffer...), not `step`
                if isinstance(v, tensor) and v.is_floating_point() and v.numel() == n:
                    role = roles.get((pname, k))
                    if role is None:
                        role = roles[(pname, k)] = param_role(pname, f"optim.{k}")
                    # optimizer state is made without autograd: no detached view to make
                    items.append((v.detach() if v.requires_grad else v, name, role))
        self._guard("optimizer-state taps", self.record_many, items, Phase.OPTIM, True)
        return None
