"""In-process telemetry for training loops: `monitor = attach(model, mesh, ...)`."""

from .exporter import HttpExporter, InMemoryExporter, JsonlExporter, NullExporter
from .monitor import Monitor, MonitorConfig, NullMonitor, attach

__all__ = [
    "HttpExporter",
    "InMemoryExporter",
    "JsonlExporter",
    "Monitor",
    "MonitorConfig",
    "NullExporter",
    "NullMonitor",
    "attach",
]
