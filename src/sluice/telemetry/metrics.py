"""Metric sinks: one JSON line per event in ``metrics.jsonl`` (and the run's other JSONL logs).

Sinks only record what they are given; computing metrics is the caller's job. They keep nothing
in memory: a record is on disk once ``log`` returns (the trained-ids log alone holds every sample
id of the run; a long run must not carry that in the driver). The console progress bar lives in
``telemetry/progress.py``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from sluice.telemetry.disk_faults import disk_faults


class JsonlMetrics:
    """Appends ``{"kind": ..., "time": ..., **values}`` records to a JSONL file."""

    def __init__(self, path: str | Path | None, *, append: bool = False) -> None:
        """``append``: keep what the file holds (a resumed run continues it); else start it empty."""
        self.path = Path(path) if path is not None else None
        self._start = time.monotonic()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append or not self.path.exists():
                self.path.write_text("")

    def log(self, kind: str, **values: Any) -> dict[str, Any]:
        record = {"kind": kind, "elapsed_s": round(time.monotonic() - self._start, 3), **values}
        record = {k: _jsonable(v) for k, v in record.items()}
        if self.path is not None:
            with disk_faults(self.path), self.path.open("a") as f:  # a full disk: one line naming the file
                f.write(json.dumps(record) + "\n")
        return record


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value
