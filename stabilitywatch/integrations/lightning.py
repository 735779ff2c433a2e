"""Lightning: `trainer = L.Trainer(callbacks=[StabilityWatchCallback(config=..., run_dir=...)])`.

The monitor is built when training starts, on the LightningModule and the trainer's optimizer,
with the trainer's global rank (and, for a torchao float8 model, its casts: see
integrations/torchao.py). One monitor step per optimizer step (steps.py): it begins with
the first micro-batch, ends when `trainer.global_step` has moved. Lightning runs the backward
of the last micro-batch inside `optimizer.step(closure)`, after the optimizer's pre-step hooks:
gradients are read in `on_before_optimizer_step` instead (after the closure, before clipping).
The loss row is the sum of the micro-batches' `training_step` losses as Lightning backpropagates
them (each divided by `accumulate_grad_batches`): the mean micro-batch loss of the step.

With a `WandbLogger` the monitor's W&B sink is added and logs into the logger's run. For
replay, pass `model_factory=` (a function building the LightningModule) and, unless the default
`stabilitywatch.integrations.lightning:replay_step` fits, `step_fn=`: the captured batch is the
list of the step's micro-batches, padded with None up to `accumulate_grad_batches` for the short
last group of an epoch.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from ..config import Config
from .steps import AccumulatedStep, build_monitor, guarded, init_callback, trainer_config

log = logging.getLogger("stabilitywatch")
REPLAY_STEP = "stabilitywatch.integrations.lightning:replay_step"


def replay_step(model: Any, micro_batches: list) -> torch.Tensor:
    """Replay's step function for a captured Lightning step, run as Lightning runs it: each
    micro-batch's `training_step` loss divided by `accumulate_grad_batches` (the list's length:
    the short last group of an epoch is captured padded with None up to it, since Lightning
    divides by `accumulate_grad_batches` there too) and backpropagated on its own, the last one
    by replay. The loss returned holds the sum of the divided losses, as the step's loss row
    does; its backward runs through the last micro-batch only."""
    present = [(i, b) for i, b in enumerate(micro_batches) if b is not None]
    if not present:
        raise ValueError("replay_step: the captured step holds no micro-batch")
    n = len(micro_batches)

    def loss_of(i: int, batch: Any) -> torch.Tensor:
        out = model.training_step(batch, i)
        return (out["loss"] if isinstance(out, dict) else out) / n

    done = None
    for i, batch in present[:-1]:
        loss = loss_of(i, batch)
        loss.backward()
        done = loss.detach() if done is None else done + loss.detach()
    last = loss_of(*present[-1])
    return last if done is None else last + done


class _Callback:
    """The body shared by the lightning.pytorch and pytorch_lightning callbacks."""

    def __init__(self, config: Optional[Config] = None, run_dir: "str | os.PathLike | None" = None,
                 model_factory: Optional[str] = None, step_fn: Optional[str] = REPLAY_STEP,
                 wandb: Optional[bool] = None):
        super().__init__()
        init_callback(self, config, run_dir, model_factory, step_fn, wandb)
        self._begun_at = -1        # trainer.global_step when the open step began

    # -- start and end ---------------------------------------------------------------------
    @guarded
    def on_train_start(self, trainer, pl_module) -> None:
        if self.monitor is not None and not self.monitor.closed:
            return
        opts = list(trainer.optimizers)
        logged = _wandb_run(trainer) if self.wandb is not False else False
        cfg = trainer_config(self.config, trainer.global_rank,
                             logged if self.wandb is None else bool(self.wandb))
        run_dir = self.run_dir
        if run_dir is None:  # one directory for every rank (a timestamp could differ)
            run_dir = os.path.join(trainer.default_root_dir, "stabilitywatch")
        self.monitor = build_monitor(pl_module, opts[0] if opts else None, config=cfg,
                                     run_dir=run_dir, model_factory=self.model_factory,
                                     step_fn=self.step_fn)
        self._acc = AccumulatedStep(self.monitor)
        if len(opts) > 1:
            log.warning("stabilitywatch: %d optimizers; the monitor reads the first one's "
                        "gradients and state", len(opts))

    @guarded
    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()

    def teardown(self, trainer, pl_module, stage) -> None:
        if stage == "fit":
            self.close()

    def close(self) -> None:
        """End the open step and close the monitor (its alerts stay in `monitor.alerts`)."""
        if self.monitor is not None and not self.monitor.closed:
            self.monitor.close()

    # -- the step --------------------------------------------------------------------------
    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._acc is None or self.monitor.closed:
            return
        if not self._acc.open:
            self._begun_at = trainer.global_step
        self._acc.micro_batch(int(trainer.global_step), batch)

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._acc is not None and self._acc.open:
            self.monitor.observe_grads()

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._acc is None or not self._acc.open:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._acc.add_loss(loss)
        if trainer.global_step != self._begun_at:   # the optimizer stepped
            # a short last group of the epoch: Lightning divided its losses by
            # accumulate_grad_batches all the same, which replay_step reads as the list's length
            short = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) - len(self._acc.batches)
            if short > 0:
                self._acc.batches.extend([None] * short)
            self._acc.finish()


def _wandb_run(trainer) -> bool:
    """True when one of the trainer's loggers is a WandbLogger; its run is made to exist (on
    rank 0) so that the monitor's W&B sink attaches to it."""
    found = False
    for lg in getattr(trainer, "loggers", None) or []:
        if any(c.__name__ == "WandbLogger" for c in type(lg).__mro__):
            found = True
            _ = lg.experiment   # the logger creates its run lazily
    return found


def _make(base: type, module: str) -> type:
    return type("StabilityWatchCallback", (_Callback, base), {
        "__doc__": __doc__, "__module__": module, "__qualname__": "StabilityWatchCallback"})


def __getattr__(name: str) -> Any:
    # built on first use: importing this module does not import lightning
    if name != "StabilityWatchCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from lightning.pytorch import Callback
    except ImportError as e:
        raise ImportError("StabilityWatchCallback needs lightning: pip install "
                          "stabilitywatch[lightning] (pytorch_lightning users: "
                          "stabilitywatch.integrations.pytorch_lightning)") from e
    cls = globals()["StabilityWatchCallback"] = _make(Callback, __name__)
    return cls
