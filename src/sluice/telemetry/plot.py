"""A run's curves over steps, from its ``metrics.jsonl``, as one PNG (``plot.png``).

Panels: reward (``train`` records' ``reward_mean``), evaluation (``eval`` records' ``accuracy`` and
any ``mean@k`` / ``pass@k``), response length, staleness (groups' and samples' mean) and
throughput (trained tokens / s), and ``sluice sft``'s training and validation loss
(``sft_loss``, ``val_loss``). A panel is drawn only for series the file has, so a run without
evaluations, or an older file, still plots (a file with neither kind yet: an empty figure that
says so). ``sluice plot RUN_DIR`` and the end of ``fit``
(``tracking.plot``) call ``plot_run``.

It deliberately does not compute metrics (it reads what the run logged) or draw timelines
(``telemetry/gantt.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_LOG = "metrics.jsonl"
PLOT_FILE = "plot.png"


class MetricsFileError(ValueError):
    """A missing or unreadable ``metrics.jsonl``, named with its line (1-based)."""


# (panel title, y label, record kind, keys drawn as lines); a key ending in "@" matches a prefix
PANELS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("reward", "mean reward", "train", ("reward_mean",)),
    ("evaluation", "accuracy", "eval", ("accuracy", "mean@", "pass@")),
    ("response length", "tokens", "train", ("response_len_mean",)),
    ("staleness", "versions", "train", ("staleness_mean", "sample_staleness_mean")),
    ("throughput", "trained tokens / s", "train", ("tokens_per_s",)),
    ("SFT loss", "NLL / trained token", "train", ("sft_loss",)),
    ("validation loss", "NLL / trained token", "eval", ("val_loss",)),
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` (blank lines skipped)."""
    if not path.is_file():
        raise MetricsFileError(f"{path} not found (a run directory holds metrics.jsonl)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise MetricsFileError(f"{path} line {number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise MetricsFileError(f"{path} line {number}: not a metrics record (an object with a 'kind')")
        records.append(record)
    return records


def series(records: list[dict[str, Any]], kind: str, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """``key -> [(step, value)]`` of the records of ``kind`` that have a step and a finite number
    under one of ``keys`` (a key ending in ``@`` takes every key with that prefix, but not the
    per-source ``<metric>/<data_source>`` ones: they stay in ``metrics.jsonl`` and the trackers)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["kind"] != kind or not isinstance(record.get("step"), int):
            continue
        for key, value in record.items():
            wanted = "/" not in key and any(key.startswith(k) if k.endswith("@") else key == k for k in keys)
            if wanted and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                out.setdefault(key, []).append((record["step"], float(value)))
    return out


def plot_run(run_dir: str | Path, png_path: str | Path | None = None) -> Path:
    """Draw ``run_dir``'s ``metrics.jsonl`` to ``png_path`` (default ``<run_dir>/plot.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_LOG)
    panels = [(title, ylabel, series(records, kind, keys)) for title, ylabel, kind, keys in PANELS]
    panels = [p for p in panels if p[2]]
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(6 * cols, 3.2 * rows), dpi=110, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (title, ylabel, lines) in zip(axes, panels, strict=False):
        for key, points in lines.items():
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(linestyle=":", linewidth=0.6, alpha=0.7)
        if len(lines) > 1:
            ax.legend(fontsize=8, frameon=False)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if not panels:  # a run that has not logged a step or an evaluation yet
        fig.text(0.5, 0.5, "no train or eval records yet", ha="center", va="center", color="grey")
    fig.suptitle(run_dir.name)
    path = Path(png_path) if png_path is not None else run_dir / PLOT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
