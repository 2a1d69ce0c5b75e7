"""Console progress for long work (SFT warm start, training): a rich bar on a terminal, and a
plain line at most every ``log_every_s`` seconds otherwise, so CI logs show progress too.

It only renders what it is given; metrics are computed elsewhere.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TrainProgress:
    """``with TrainProgress(total, "train") as bar: bar.update(step, reward=..., acc=...)``."""

    def __init__(
        self,
        total: int,
        label: str = "train",
        enabled: bool = True,
        console: Console | None = None,
        log_every_s: float = 15.0,
    ) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.console = console or Console()
        self.log_every_s = log_every_s
        self._live = enabled and self.console.is_terminal
        self._last_line = 0.0
        self._started = time.monotonic()
        self._progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not self._live,
        )
        self._task = self._progress.add_task(label, total=total, info="")
        self._shown = False  # started on the first update, so work that never runs shows nothing

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._shown:
            self._progress.stop()

    def set_total(self, total: int) -> None:
        """The step count, once known (e.g. derived from the rows read)."""
        self.total = total
        self._progress.update(self._task, total=total)

    def update(self, step: int, **fields: float | None) -> None:
        info = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items() if v is not None)
        if not self._shown:
            self._shown = True
            self._progress.start()
        self._progress.update(self._task, completed=step, info=info)
        now = time.monotonic()
        plain = self.enabled and not self._live
        if plain and (now - self._last_line >= self.log_every_s or step == self.total):
            self._last_line = now
            elapsed = now - self._started
            self.console.print(f"{self.label} {step}/{self.total} [{elapsed:.0f}s] {info}", highlight=False)


def _fmt(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}"
