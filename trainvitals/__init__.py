"""trainvitals: health monitoring for large distributed training runs."""

__version__ = "0.1.0"
