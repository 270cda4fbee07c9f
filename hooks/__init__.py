"""In-process telemetry for training loops: `monitor = attach(model, mesh, ...)`."""

from .exporter import HttpExporter, InMemoryExporter, NullExporter
from .monitor import Monitor, MonitorConfig, attach

__all__ = ["HttpExporter", "InMemoryExporter", "Monitor", "MonitorConfig", "NullExporter", "attach"]
