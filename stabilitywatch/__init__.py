"""stabilitywatch: a mixed-precision numerical stability monitor for PyTorch training."""
from .alert import Alert, Severity
from .capture.reader import CaptureError
from .capture.replay import replay
from .config import (Backend, CaptureConfig, Config, DistConfig, DriftConfig, GuardConfig,
                     IncidentConfig, RangeConfig, Role, ShadowConfig, SinkConfig, SpikeConfig,
                     UpdateConfig)
from .formats import FORMATS, Fmt, FormatSpec
from .hooks.logits import LogitsTap
from .monitor import Monitor, watch
from .stats.derive import tensor_stats
from .stats.layout import Stat

__version__ = "0.1.0"

__all__ = ["Alert", "Backend", "Config", "FORMATS", "Fmt", "FormatSpec", "LogitsTap", "Monitor",
           "Role", "Severity", "Stat", "tensor_stats", "watch", "__version__",
           "replay", "CaptureError", "CaptureConfig", "DistConfig", "DriftConfig", "GuardConfig",
           "IncidentConfig", "RangeConfig", "ShadowConfig", "SinkConfig", "SpikeConfig",
           "UpdateConfig"]
