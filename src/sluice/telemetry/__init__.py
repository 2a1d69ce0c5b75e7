"""Telemetry: metric sinks and the console progress bar."""

from sluice.telemetry.metrics import JsonlMetrics
from sluice.telemetry.progress import TrainProgress

__all__ = ["JsonlMetrics", "TrainProgress"]
