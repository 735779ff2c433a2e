"""What replay may run. A bundle is untrusted: the model factory and step function it records are
text to show, never code to run on the bundle's word. Only names the user gives (or confirms
with `trust_recorded`) are imported, and what they return is checked before it is used; the
optimizer class a bundle names is looked up among torch.optim's own classes, never imported.
"""
from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable

import torch
import torch.nn as nn

from .reader import CaptureError

_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def is_import_path(path: Any) -> bool:
    """'package.module:function' (ASCII identifiers, dots): nothing a shell or terminal reads
    as anything else."""
    if not isinstance(path, str) or path.count(":") != 1:
        return False
    mod, attr = path.split(":")
    return all(_PART.match(x) for x in mod.split(".") + attr.split("."))


def shown(path: Any) -> str:
    """A recorded name as it may be printed: as is when it is an import path, else its repr."""
    return path if is_import_path(path) else repr(path)


def resolve(path: Any, what: str) -> Callable:
    """Import `path` ('package.module:function'): a name the user gave, or confirmed."""
    if not is_import_path(path):
        raise CaptureError(f"{what} {shown(path)} is not an import path 'package.module:function'")
    mod_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CaptureError(f"cannot import {what} {path!r} ({type(e).__name__}: {e})") from None
    if not callable(obj):
        raise CaptureError(f"{what} {path!r} is not callable")
    return obj


def untrusted_message(factory_given: bool, step_given: bool) -> str:
    """What to pass when replay would otherwise run a name that only the bundle supplies. The
    recorded names are not echoed as a command to copy: `inspect` shows them in context."""
    need = [f"{flag} PKG.MOD:FN" for given, flag in ((factory_given, "--model-factory"),
                                                     (step_given, "--step-fn")) if not given]
    return (f"replay runs only code you name: pass {' '.join(need)} (your own functions), or "
            f"--trust-recorded to run the ones the capture records after checking them with "
            f"`stabilitywatch inspect CAPTURE` (Python: model_factory=, step_fn=, "
            f"trust_recorded=True)")


def pick(given: Any, recorded: Any, what: str, flag: str) -> tuple[Callable, str]:
    if callable(given):
        return given, getattr(given, "__qualname__", repr(given))
    if given is not None and not isinstance(given, str):
        raise CaptureError(f"{what} must be an import path 'package.module:function' or a "
                           f"callable, got a {type(given).__name__}")
    if given is None and recorded is None:
        raise CaptureError(f"the capture records no {what}: pass {flag} PKG.MOD:FN")
    name = given if given is not None else recorded
    return resolve(name, what), name


def checked_factory(fn: Callable, name: str) -> Callable[[], nn.Module]:
    @functools.wraps(fn)
    def factory() -> nn.Module:
        model = fn()
        if not isinstance(model, nn.Module):
            raise CaptureError(f"the model factory {name} returned a {type(model).__name__}, "
                               f"not a torch.nn.Module")
        return model
    return factory


def checked_step(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = fn(model, batch)
        if not (isinstance(loss, torch.Tensor) and loss.is_floating_point()
                and loss.numel() == 1):
            what = (f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
            raise CaptureError(f"the step function {name} returned {what}, not the loss (a "
                               f"floating-point scalar tensor)")
        if not loss.requires_grad:
            raise CaptureError(f"the step function {name} returned a loss that does not "
                               f"require grad: replay runs loss.backward()")
        return loss
    return step


def torch_optimizer(path: Any) -> type:
    """The torch.optim class a bundle names, looked up among torch.optim's own classes (the
    recorded text is compared, never imported)."""
    name = path.rpartition(".")[2] if isinstance(path, str) else ""
    cls = getattr(torch.optim, name, None) if _PART.match(name) else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
            and f"{cls.__module__}.{cls.__qualname__}" == path):
        raise CaptureError(f"optimizer {shown(path)} is not one of torch.optim's; pass "
                           f"optimizer=callable(param_groups) to replay()")
    return cls
