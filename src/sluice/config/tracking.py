"""Config section of where a run's metrics and sample generations go, beside ``metrics.jsonl``.

Only declares and validates; the sinks themselves live in ``telemetry/``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.section import Section as _Section


class TrackingConfig(_Section):
    trackers: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Metric sinks beside ``metrics.jsonl`` (any together): ``tensorboard`` (event files in
    ``<run dir>/tensorboard``), ``wandb`` (a run under ``<run dir>/wandb`` with the run's config).
    Both need ``pip install 'sluice[track]'``; every train and eval record goes to each as
    ``train/<key>`` / ``eval/<key>`` scalars at its step (docs/tracking.md)."""

    wandb_project: str = "sluice"
    """wandb project name."""

    wandb_mode: Literal["online", "offline"] = "offline"
    """``offline`` writes the run under ``<run dir>/wandb`` with no network (``wandb sync`` uploads
    it later); ``online`` streams to the server (needs ``WANDB_API_KEY``)."""

    samples_every: int = Field(default=10, ge=0)
    """Every this many steps, write some of the step's generations (prompt, response, reward,
    version, staleness) to ``samples.jsonl`` and the trackers (0: never)."""

    samples_per_step: int = Field(default=4, ge=1)
    """How many generations each such step writes."""

    plot: bool = True
    """Draw ``plot.png`` (reward, accuracy, response length, staleness, throughput over steps) at
    the end of the run; ``sluice plot RUN_DIR`` draws it any time."""
