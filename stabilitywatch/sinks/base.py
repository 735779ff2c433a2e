"""The Sink ABC (defined in stabilitywatch/extensions.py, beside the Detector protocol, so that
config.py can check Config.sinks without importing this package)."""
from ..extensions import Sink

__all__ = ["Sink"]
