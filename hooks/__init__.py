"""In-process telemetry for training loops: `monitor = attach(model, mesh, ...)`."""

from .exporter import HttpExporter, InMemoryExporter, NullExporter
from .monitor import Monitor, MonitorConfig, NullMonitor, attach

__all__ = [
    "HttpExporter",
    "InMemoryExporter",
    "Monitor",
    "MonitorConfig",
    "NullExporter",
    "NullMonitor",
    "attach",
]
