"""The console progress bar of a training run (rich): step, reward, accuracy, tokens/s.

A no-op when disabled or when stdout is not a terminal-like stream, so logs stay clean in CI.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TrainProgress:
    """``with TrainProgress(total, enabled) as bar: bar.update(step, reward=..., ...)``."""

    def __init__(self, total: int, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total, info="")

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def update(self, step: int, **fields: float | None) -> None:
        info = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items() if v is not None)
        self._progress.update(self._task, completed=step, info=info)


def _fmt(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}"
