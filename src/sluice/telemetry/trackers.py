"""Metric sinks beside ``metrics.jsonl``: TensorBoard and wandb, each through its own library.

``open_trackers`` builds the sinks ``tracking.trackers`` names; ``Trackers`` hands every one the
same scalars (``<kind>/<key>`` at a step, e.g. ``train/reward_mean``, ``eval/accuracy``) and
sample tables, and closes them at the end of the run. TensorBoard writes event files under
``<run dir>/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``); wandb a run under
``<run dir>/wandb`` (``offline``: no network, ``wandb sync`` uploads it later). A resumed run
appends: TensorBoard adds an event file to the same folder, wandb continues the same run id
(kept in ``<run dir>/wandb/sluice_run_id``); wandb's x axis is the logged ``step`` (not its own
counter), so the steps a resume redoes are accepted.

It deliberately does not compute metrics (the run does), write ``metrics.jsonl``
(``telemetry/metrics.py``) or choose which samples to show (``controller/run_state.py``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from sluice.config import ConfigError, TrackingConfig

TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID = "wandb/sluice_run_id"
SAMPLE_COLUMNS = ("step", "group_id", "version", "staleness", "reward", "prompt", "response")
"""The columns of a sample table (``samples.jsonl`` records hold the same keys)."""


class Tracker(Protocol):
    """One metric sink."""

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table of sample generations (``SAMPLE_COLUMNS``) at ``step``."""
        ...

    def close(self, failed: bool = False) -> None: ...


def _require(module: str, tracker: str) -> ModuleType:
    """Import a tracker's library, or one clear error naming the option and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"tracking.trackers: {tracker!r} needs a package that is not installed ({err}); "
            "install it with: pip install 'sluice[track]'"
        ) from None


class TensorBoardTracker:
    """Event files in ``log_dir``: a scalar per key, samples as a Markdown table (``add_text``)."""

    def __init__(self, log_dir: Path) -> None:
        tensorboard = _require("torch.utils.tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(log_dir=str(log_dir))

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(_cell(row[c]) for c in SAMPLE_COLUMNS) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(lines), global_step=step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run in ``<run_dir>/wandb`` with the run's config; samples as a ``wandb.Table``."""

    def __init__(self, run_dir: Path, tracking: TrackingConfig, config: dict[str, Any], *, resume: bool) -> None:
        self.wandb = _require("wandb", "wandb")
        id_file = run_dir / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None  # None: wandb picks
        self.run = self.wandb.init(
            project=tracking.wandb_project,
            dir=str(run_dir),
            mode=tracking.wandb_mode,
            config=config,
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({"step": step, **values})

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[row[c] for c in SAMPLE_COLUMNS] for row in rows])
        self.run.log({"step": step, "samples": table})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """Every sink of the run (none: every call does nothing)."""

    def __init__(self, sinks: Sequence[Tracker] = ()) -> None:
        self.sinks = list(sinks)

    def log_record(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        """A ``metrics.jsonl`` record's numbers as ``<kind>/<key>`` scalars (``step`` is the axis;
        text and lists stay in the JSONL file, a non-finite number is left out as it is there)."""
        values = {
            f"{kind}/{key}": float(value)
            for key, value in record.items()
            if key not in ("kind", "step") and _is_number(value) and math.isfinite(value)
        }
        for sink in self.sinks:
            sink.log_scalars(step, values)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        for sink in self.sinks:
            sink.log_samples(step, rows)

    def close(self, failed: bool = False) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)


def open_trackers(tracking: TrackingConfig, run_dir: Path, config: dict[str, Any], *, resume: bool) -> Trackers:
    """The sinks ``tracking.trackers`` names; ``config`` (the run's config dump) goes to wandb."""
    sinks: list[Tracker] = []
    for name in dict.fromkeys(tracking.trackers):
        if name == "tensorboard":
            sinks.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR))
        else:
            sinks.append(WandbTracker(run_dir, tracking, config, resume=resume))
    return Trackers(sinks)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    """One Markdown table cell: pipes escaped, newlines as ``⏎`` so a row stays one line."""
    return str(value).replace("|", "\\|").replace("\n", " ⏎ ")
