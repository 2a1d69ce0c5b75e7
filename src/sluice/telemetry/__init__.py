"""Telemetry: metric sinks, the console progress bar, timeline spans (Chrome trace) and Gantt plots."""

from sluice.telemetry.metrics import JsonlMetrics
from sluice.telemetry.progress import TrainProgress
from sluice.telemetry.trace import SpanRecorder, trace_summary, write_chrome_trace

__all__ = ["JsonlMetrics", "SpanRecorder", "TrainProgress", "trace_summary", "write_chrome_trace"]
