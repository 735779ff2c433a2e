"""Sinks: where statistics records and alerts go. wandb and tensorboard are imported only when
their sink is created, so this package imports without them."""
from .base import Sink
from .console import ConsoleSink
from .jsonl import JsonlSink
from .runner import SinkRunner
from .dashboard import Dashboard
from .tensorboard_sink import TensorBoardSink
from .wandb_sink import WandbSink

__all__ = ["Sink", "SinkRunner", "JsonlSink", "ConsoleSink", "WandbSink", "TensorBoardSink",
           "Dashboard"]
