"""stabilitywatch: a mixed-precision numerical stability monitor for PyTorch training."""
from .alert import Alert, Severity
from .capture.reader import CaptureError
from .replaying import replay
from .config import (Backend, CaptureConfig, Config, DistConfig, DriftConfig, GuardConfig,
                     IncidentConfig, RangeConfig, Role, ShadowConfig, SinkConfig, SpikeConfig,
                     UpdateConfig)
from .extensions import Detector, Sink
from .formats import FORMATS, Fmt, FormatSpec
from .hooks.logits import LogitsTap
from .monitor import Monitor, watch
from .kernels.backend import tensor_stats
from .stats.frame import StatsFrame
from .stats.layout import Stat

__version__ = "0.1.0"

__all__ = ["Alert", "Backend", "CaptureError", "Config", "Detector", "FORMATS", "Fmt",
           "FormatSpec", "LogitsTap", "Monitor", "Role", "Severity", "Sink", "Stat",
           "StatsFrame", "replay", "tensor_stats", "watch", "__version__",
           "CaptureConfig", "DistConfig", "DriftConfig", "GuardConfig", "IncidentConfig",
           "RangeConfig", "ShadowConfig", "SinkConfig", "SpikeConfig", "UpdateConfig"]
