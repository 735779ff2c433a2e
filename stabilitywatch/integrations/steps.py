"""What the trainer callbacks share: one monitor step per optimizer step, whatever the
gradient accumulation, and a guard so that a failing callback never stops training.

A step begins with its first micro-batch and ends after the optimizer step. Every micro-batch
runs inside it, so the rows of a module called once per micro-batch merge into one row (sums
add, min/max combine): the statistics of the whole accumulated batch. The batch kept for
capture is the list of the step's micro-batches (replay's step function receives that list);
its floating tensors are read as module "" roles `input.<micro-batch>.<tensor>` (one row per
micro-batch tensor, the names replay gives them).
The loss row holds the loss of the optimizer step as the trainer reports it, summed on the
device from the micro-batches' losses (no host sync).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from ..config import Config

log = logging.getLogger("stabilitywatch")


class AccumulatedStep:
    def __init__(self, monitor: Any):
        self.mon = monitor
        self.step: Optional[int] = None
        self.batches: list = []
        self._loss: Optional[torch.Tensor] = None
        self._losses = 0

    @property
    def open(self) -> bool:
        return self.step is not None

    def micro_batch(self, step: int, batch: Any = None) -> None:
        """A micro-batch starts: the first one of an optimizer step begins the monitor's step."""
        if self.step is None:
            self.step, self.batches, self._loss, self._losses = step, [], None, 0
            # by reference: the capture of this step sees every micro-batch appended below
            self.mon.begin_step(step, batch=self.batches)
        if batch is not None:
            self.batches.append(batch)

    def add_loss(self, loss: Any) -> None:
        if self.step is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().float().reshape(())
        self._loss = loss if self._loss is None else self._loss + loss
        self._losses += 1

    def finish(self, mean: bool = False, factor: float = 1.0) -> None:
        """The optimizer step is done: the loss (the micro-batches' sum, or their mean) goes
        into the step, which ends."""
        if self.step is None:
            return
        try:
            # the batch rows as replay names them (it starts the step with the whole list):
            # input.<micro-batch>.<tensor>
            self.mon.observe_batch(self.batches)
            if self._loss is not None:
                loss = self._loss / self._losses if mean else self._loss
                self.mon.observe_loss(loss * factor if factor != 1.0 else loss)
        finally:
            self.step, self._loss = None, None
            self.mon.end_step()


def trainer_config(config: Optional[Config], rank: int, wandb: bool) -> Config:
    """The user's Config with the trainer's rank and, when the trainer logs to W&B, the W&B sink
    (it attaches to the run the trainer's logger opened)."""
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"StabilityWatchCallback: config must be a stabilitywatch.Config, "
                        f"got {type(config).__name__}")
    changes: dict = {}
    if config.rank is None and rank:
        changes["rank"] = int(rank)
    if wandb and "wandb" not in config.sinks.use:
        changes["sinks"] = config.sinks.use + ("wandb",)
    return config.replace(**changes) if changes else config


def build_monitor(model: Any, optimizer: Any, config: Config, **kwargs: Any):
    """sw.watch, and for a torchao float8 model its casts too (integrations/torchao.py)."""
    from ..monitor import watch
    from . import torchao
    float8 = torchao.uses_float8(model)
    if float8:
        config = torchao.float8_config(model, config)
    mon = watch(model, optimizer, config=config, **kwargs)
    if float8:
        try:
            torchao.attach_float8(mon)
        except Exception:
            mon.close()
            raise
    return mon


def guarded(fn: Callable) -> Callable:
    """A callback method that logs its failure once and lets training go on."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:
            key = fn.__name__
            if key not in self._failed:
                self._failed.add(key)
                log.warning("stabilitywatch: %s.%s failed (%s: %s); training goes on",
                            type(self).__name__, key, type(e).__name__, e)
            return None
    return wrapper


def check_path(label: str, path: Optional[str]) -> None:
    # the callback builds the monitor later (when the trainer starts): check what enters now
    if path is not None and (not isinstance(path, str) or ":" not in path):
        raise ValueError(f"StabilityWatchCallback: {label} must be an import path "
                         f"'package.module:function', got {path!r}")


def init_callback(cb: Any, config: Optional[Config], run_dir: Any, model_factory: Optional[str],
                  step_fn: Optional[str], wandb: Optional[bool]) -> None:
    """The arguments every trainer callback takes, checked where they enter, and its state."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"StabilityWatchCallback: config must be a stabilitywatch.Config, "
                        f"got {type(config).__name__}")
    check_path("model_factory", model_factory)
    check_path("step_fn", step_fn)
    cb.config, cb.run_dir = config, run_dir
    cb.model_factory, cb.step_fn, cb.wandb = model_factory, step_fn, wandb
    cb.monitor = None
    cb._acc = None            # the open optimizer step's AccumulatedStep
    cb._failed = set()
