"""stabilitywatch: a mixed-precision numerical stability monitor for PyTorch training."""
from .alert import Alert, Severity
from .config import Backend, Config, Role
from .formats import FORMATS, Fmt, FormatSpec
from .monitor import Monitor, watch
from .stats.derive import tensor_stats
from .stats.layout import Stat

__version__ = "0.1.0"

__all__ = ["Alert", "Backend", "Config", "FORMATS", "Fmt", "FormatSpec", "Monitor", "Role",
           "Severity", "Stat", "tensor_stats", "watch", "__version__"]
