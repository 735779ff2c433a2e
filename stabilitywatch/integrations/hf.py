"""HF transformers: `Trainer(..., callbacks=[StabilityWatchCallback(config=..., run_dir=...)])`.

The monitor is built in `on_train_begin` on the trainer's model and optimizer (Accelerate's
wrapper is unwrapped: the hooks go on the torch optimizer inside), with the trainer's process
index as rank (and, for a torchao float8 model, its casts: see integrations/torchao.py). One
monitor step per optimizer step (steps.py): `on_step_begin` (called at the first micro-batch)
begins it, `on_step_end` (after the optimizer step) ends it. A forward
pre-hook on the model keeps each micro-batch (the keyword arguments the trainer calls the model
with) for capture, and a forward hook adds up the model's own loss on the device. The loss row
is the loss the trainer logs for the step: the micro-batches' losses summed when the model
normalised them by `num_items_in_batch` (the trainer then does not divide), their mean
otherwise. With `label_smoothing_factor` or a `compute_loss_func` the row holds the model's own
loss, not the trainer's.

With `report_to` holding "wandb" the monitor's W&B sink is added and logs into the run the
trainer's WandbCallback opened. For replay, pass `model_factory=` (a function building the
model); the default `step_fn` runs the captured micro-batches through it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from ..config import Config
from .steps import AccumulatedStep, build_monitor, guarded, init_callback, trainer_config

log = logging.getLogger("stabilitywatch")
REPLAY_STEP = "stabilitywatch.integrations.hf:replay_step"


def replay_step(model: Any, micro_batches: list) -> torch.Tensor:
    """Replay's step function for a captured Trainer step: the loss the trainer backpropagates
    over the step's micro-batches."""
    losses = [_loss_of(model(**batch)) for batch in micro_batches]
    total = sum(losses[1:], losses[0])
    scaled = any("num_items_in_batch" in b for b in micro_batches)
    return total if scaled else total / len(losses)


def _loss_of(out: Any) -> Optional[torch.Tensor]:
    # as the Trainer reads it: outputs["loss"] from a ModelOutput or dict, else the first item
    if isinstance(out, dict):
        return out.get("loss")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return getattr(out, "loss", None)


def _base():
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ImportError("stabilitywatch.integrations.hf needs transformers: pip install "
                          "stabilitywatch[hf]") from e
    return TrainerCallback


class StabilityWatchCallback(_base()):
    """Watch a `transformers.Trainer` run: see the module docstring."""

    def __init__(self, config: Optional[Config] = None, run_dir: "str | os.PathLike | None" = None,
                 model_factory: Optional[str] = None, step_fn: Optional[str] = REPLAY_STEP,
                 wandb: Optional[bool] = None):
        init_callback(self, config, run_dir, model_factory, step_fn, wandb)
        self._handles: list = []
        self._scaled = False       # this step's micro-batches came with num_items_in_batch
        self._factor = 1.0

    @guarded
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if (self.monitor is not None and not self.monitor.closed) or model is None:
            return
        self.close()     # a second train(): the first monitor's hooks go
        report_to = args.report_to
        report_to = report_to if isinstance(report_to, (list, tuple)) else [report_to]
        wandb = self.wandb if self.wandb is not None else "wandb" in report_to
        cfg = trainer_config(self.config, args.process_index, bool(wandb))
        run_dir = self.run_dir
        if run_dir is None:  # one directory for every rank (a timestamp could differ)
            run_dir = os.path.join(args.output_dir or ".", "stabilitywatch")
        self.monitor = build_monitor(model, optimizer, config=cfg, run_dir=run_dir,
                                     model_factory=self.model_factory, step_fn=self.step_fn)
        self._acc = AccumulatedStep(self.monitor)
        # average_tokens_across_devices: the trainer multiplies the model's loss by the number
        # of processes before it logs the mean over them
        if getattr(args, "average_tokens_across_devices", False) and args.world_size > 1:
            self._factor = float(args.world_size)
        self._handles = [
            model.register_forward_pre_hook(self._keep_batch, with_kwargs=True),
            model.register_forward_hook(self._keep_loss, with_kwargs=True)]

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        if self._acc is not None and not self.monitor.closed:
            self._scaled = False
            self._acc.micro_batch(int(state.global_step))

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self._acc is not None:
            self._acc.finish(mean=not self._scaled,
                             factor=self._factor if self._scaled else 1.0)

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Remove the hooks, end the open step and close the monitor (its alerts stay in
        `monitor.alerts`). Training that raises never reaches on_train_end: call it then."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.monitor is not None and not self.monitor.closed:
            self.monitor.close()

    # -- model hooks (training micro-batches only) ----------------------------------------------
    def _live(self, module) -> bool:
        return (self._acc is not None and self._acc.open and module.training
                and torch.is_grad_enabled())

    def _keep_batch(self, module, args, kwargs):
        try:
            if self._live(module):
                batch = {k: v for k, v in kwargs.items()
                         if isinstance(v, (torch.Tensor, int, float, bool))}
                self._scaled = self._scaled or "num_items_in_batch" in batch
                self._acc.batches.append(batch)
        except Exception as e:
            self._warn("batch", e)
        return None

    def _keep_loss(self, module, args, kwargs, output):
        try:
            if self._live(module):
                self._acc.add_loss(_loss_of(output))
        except Exception as e:
            self._warn("loss", e)
        return None

    def _warn(self, key: str, e: Exception) -> None:
        if key not in self._failed:
            self._failed.add(key)
            log.warning("stabilitywatch: keeping the trainer's %s failed (%s: %s); training "
                        "goes on", key, type(e).__name__, e)
