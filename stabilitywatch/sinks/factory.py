"""Build the sinks of a Config: names are made here, Sink instances (plug-in sinks) are used as
they are; a sink that cannot start is reported once and skipped."""
from __future__ import annotations

import logging
from pathlib import Path

from ..config import Config
from .base import Sink

log = logging.getLogger("stabilitywatch")


def make_sinks(config: Config, run_dir: Path, rank: int, world_size: int) -> list[Sink]:
    sinks: list[Sink] = []
    for name in config.sinks.use:
        if isinstance(name, Sink):
            sinks.append(name)
            continue
        try:
            if name == "jsonl":
                from .jsonl import JsonlSink
                sinks.append(JsonlSink(run_dir, rank=rank, world_size=world_size))
            elif name == "console":
                from .console import ConsoleSink
                # info alerts (drift change points) go to files and dashboards, not the log
                sinks.append(ConsoleSink(min_severity="warning"))
            elif name == "wandb":
                from .wandb_sink import WandbSink
                sinks.append(WandbSink(run_dir, project=config.sinks.wandb_project,
                                       config=config, rank=rank, world_size=world_size,
                                       run=config.sinks.wandb_run))
            elif name == "tensorboard":
                from .tensorboard_sink import TensorBoardSink
                sinks.append(TensorBoardSink(run_dir, config=config, rank=rank,
                                             world_size=world_size))
        except Exception as e:
            log.warning("stabilitywatch: sink %r could not start (%s: %s); running without it",
                        name, type(e).__name__, e)
    return sinks
