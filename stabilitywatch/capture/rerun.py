"""Re-running a captured step: rebuild the model and optimizer from the bundle, restore RNG and
batch, and run `step_fn(model, batch) -> loss`, backward and the optimizer step.

The model factory and step function are the user's (trust.py decides which names may be
imported, and checks what they return); opening or inspecting a bundle imports nothing. The
monitor that re-runs the step is handed in (`watch`, stabilitywatch.watch): capture/ sits below
the Monitor and does not import it.
"""
from __future__ import annotations

import fnmatch
import functools
import glob
import random
import tempfile
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from .reader import Capture, CaptureError, rng_numpy, rng_python
from .trust import checked_factory, checked_step, pick, torch_optimizer, untrusted_message
from .treeio import config_from_json, decode_tree

LOW_DTYPES = (torch.float16, torch.bfloat16)


class Setup:
    """Everything needed to start the captured step again, as many times as asked."""

    def __init__(self, cap: Capture, model_factory: "str | Callable | None" = None,
                 step_fn: "str | Callable | None" = None, device: Optional[str] = None,
                 optimizer: Optional[Callable] = None, trust_recorded: bool = False,
                 watch: Optional[Callable] = None):
        m = cap.manifest
        self.watch = watch
        self.cap, self.step = cap, cap.step
        if not trust_recorded and (model_factory is None or step_fn is None):
            raise CaptureError(untrusted_message(model_factory is not None, step_fn is not None))
        recorded = (m.get("device") or {}).get("type", "cpu")
        if device is None:
            device = "cuda" if recorded == "cuda" and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise CaptureError("--device cuda asked for, but no CUDA device is visible")
        self.optimizer_factory = optimizer
        meta = m.get("optimizer")
        self._opt_cls = torch_optimizer(meta.get("class")) if (
            optimizer is None and isinstance(meta, dict)) else None
        trusted = m if trust_recorded else {}
        factory, fname = pick(model_factory, trusted.get("model_factory"), "model factory",
                               "--model-factory")
        step, sname = pick(step_fn, trusted.get("step_fn"), "step function", "--step-fn")
        self.step_fn = checked_step(step, sname)
        self.names = {"model_factory": fname, "step_fn": sname}   # what runs, for the report
        checked = checked_factory(factory, fname)
        first = [checked()]   # a factory that returns something else fails before anything runs

        def build() -> nn.Module:
            return first.pop() if first else checked()
        self.factory = build
        self.lacks = bundle_lacks(m)
        self.state = {} if "model" in self.lacks else cap.tensors("model")
        self.optim_state = {} if "optimizer" in self.lacks else cap.tensors("optimizer")
        self.modules = list(m.get("modules") or [])

    # -- pieces ----------------------------------------------------------------------------
    def model(self, dtype: Optional[torch.dtype] = None) -> nn.Module:
        model = self.factory()
        if not isinstance(model, nn.Module):
            raise CaptureError(f"the model factory returned a {type(model).__name__}, "
                               f"not a torch.nn.Module")
        model.to(self.device)
        with torch.no_grad():
            for name, t in self.state.items():
                try:
                    dst = model.get_parameter(name)
                except AttributeError:
                    try:
                        dst = model.get_buffer(name)
                    except AttributeError:
                        raise CaptureError(f"the model from the factory has no parameter or "
                                           f"buffer {name!r}: not the captured model") from None
                if dst.shape != t.shape:
                    raise CaptureError(f"{name}: shape {tuple(t.shape)} in the capture, "
                                       f"{tuple(dst.shape)} in the model from the factory")
                dst.copy_(t)
        if dtype is not None:
            model.to(dtype)
        return model

    def optimizer(self, model: nn.Module) -> Optional[torch.optim.Optimizer]:
        meta = self.cap.manifest.get("optimizer")
        if not meta:
            return None
        params = dict(model.named_parameters())
        groups = []
        for g in meta["param_groups"]:
            hyper = {k: _hyper(v) for k, v in g.items() if k != "params"}
            groups.append({**hyper, "params": [params[n] for n in g["params"]]})
        if self.optimizer_factory is not None:
            opt = self.optimizer_factory(groups)
        else:
            opt = (self._opt_cls or torch_optimizer(meta["class"]))(groups)
        state: dict[int, dict] = {}
        for key, t in self.optim_state.items():
            i, _, k = key.partition(".")
            # a copy: load_state_dict keeps tensors of the parameter's dtype as they are, and the
            # step updates them in place; every run starts from the captured state
            state.setdefault(int(i), {})[k] = t.clone()
        other = {} if "optimizer" in self.lacks else (meta.get("other_state") or {})
        for key, v in other.items():
            i, _, k = key.partition(".")
            state.setdefault(int(i), {})[k] = v
        sd = opt.state_dict()
        opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
        return opt

    def batch(self, dtype: Optional[torch.dtype] = None) -> Any:
        tensors = {k: _to(v, self.device, dtype) for k, v in self.cap.tensors("batch").items()}
        return decode_tree(self.cap.manifest["batch"], tensors)

    def restore_rng(self) -> None:
        if "rng" in self.lacks:
            return
        rng = self.cap.manifest["rng"]
        st = rng_python(rng)
        if st is not None:
            random.setstate(st)
        st = rng_numpy(rng)
        if st is not None:
            np.random.set_state(st)
        t = self.cap.tensors("rng")
        torch.set_rng_state(t["torch"])
        cuda = [t[f"cuda.{i}"] for i in range(int(rng.get("cuda_devices", 0)))]
        if cuda and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])

    def config(self, **overrides):
        names = tuple(glob.escape(n) for n in self.modules)
        base = {"modules": names, "module_types": (), "exclude": (), "sinks": (), "capture": ()}
        return config_from_json(self.cap.manifest["config"], **{**base, **overrides})

    def matching(self, model: nn.Module, patterns: list[str]) -> list[str]:
        return [n for n, _ in model.named_modules() if n and
                any(fnmatch.fnmatchcase(n, p) for p in patterns)]

    # -- one step --------------------------------------------------------------------------
    def run_monitored(self, upcast: tuple[str, ...] = ()):
        """The step as recorded (optionally with modules forced to fp32) under a fresh Monitor
        with the capture's Config. Returns (frame of the step or None, alerts, loss)."""
        if self.watch is None:
            raise CaptureError("re-running a step needs the monitor: call stabilitywatch.replay "
                               "(or pass watch=stabilitywatch.watch)")
        watch = self.watch
        model = self.model()
        for name in self.matching(model, list(upcast)):
            force_precision(model.get_submodule(name), torch.float32, self.device.type)
        opt = self.optimizer(model)
        batch = self.batch()
        frames: list = []
        with tempfile.TemporaryDirectory(prefix="sw-replay-") as tmp:
            mon = watch(model, opt, config=self.config(), run_dir=tmp)
            handle = mon._handle

            def keep(frame):  # the frame itself, for a bit-for-bit comparison of its rows
                frames.append(frame)
                handle(frame)
            mon._handle = keep
            if self.cap.manifest.get("escalated_step") is True:
                mon.schedule.force_next()   # the run read every role at this step
            self.restore_rng()
            try:
                with mon.step(self.step, batch=batch):
                    loss = self.step_fn(model, batch)
                    loss.backward()
                    mon.observe_loss(loss)
                    if opt is not None:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            finally:
                mon.close()
        frame = next((f for f in frames if f.step == self.step), None)
        return frame, [a for a in mon.alerts if a.step == self.step], loss.detach()


PARTS = ("model", "optimizer", "batch", "rng")


def bundle_lacks(m: dict) -> list[str]:
    """What the manifest says the bundle was written without (`lacks`: some of PARTS); replay
    runs without those parts (the factory's weights, a fresh optimizer state, unrestored RNG)
    and says so in its verdict."""
    lacks = m.get("lacks") or []
    if not (isinstance(lacks, list) and all(isinstance(x, str) for x in lacks)):
        raise CaptureError("manifest.json field 'lacks' is malformed (expected a list of "
                           f"{', '.join(PARTS)})")
    bad = [x for x in lacks if x not in PARTS]
    if bad:
        raise CaptureError(f"manifest.json field 'lacks' names {bad[0]!r}: expected some of "
                           f"{', '.join(PARTS)}")
    return list(dict.fromkeys(lacks))


def force_precision(mod: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Run `mod` in `dtype`: autocast off inside it, floating inputs of lower precision cast up,
    its own lower-precision parameters converted. Replay-only: the model is a fresh copy."""
    if any(p.dtype in LOW_DTYPES or (p.is_floating_point() and p.dtype != dtype
                                     and dtype == torch.float64) for p in mod.parameters()):
        mod.to(dtype)
    orig = mod.forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        args, kwargs = _up((args, kwargs), dtype)
        with torch.autocast(device_type=device_type, enabled=False):
            return orig(*args, **kwargs)
    mod.forward = forward


def _up(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and (obj.dtype in LOW_DTYPES or dtype == torch.float64):
            return obj.to(dtype)
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_up(x, dtype) for x in obj)
    if isinstance(obj, list):
        return [_up(x, dtype) for x in obj]
    if isinstance(obj, dict):
        return {k: _up(v, dtype) for k, v in obj.items()}
    return obj


def _to(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = t.to(device)
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _hyper(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"tensor"}:
        return torch.tensor(v["tensor"])
    if isinstance(v, list):
        return tuple(v)   # betas and the like were tuples
    return v
