"""Gantt chart of a trace: one row per (process, lane), bars coloured by span category.

Like AsyncFlow's workflow figure (Fig. 11): it shows at a glance whether generation, reward,
training and weight sync overlap or wait on each other. Nested spans are drawn thinner on top of
their parent; instants are black ticks. Bars are batched per (row, category, depth) into one
``broken_barh`` call, so traces with many thousands of spans render in about a second.

It deliberately does not: record or merge spans (``telemetry/trace.py``), compute statistics
(``trace_summary``), or offer interactivity (open the JSON in Perfetto for that).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sluice.telemetry.trace import OTHER, Span, read_chrome_trace, resolve_spans

# Category -> colour (Tableau-like); "wait" is light grey so idle time reads as a gap.
CATEGORY_COLORS: dict[str, str] = {
    "generate": "#4C78A8",
    "reward": "#F58518",
    "train": "#54A24B",
    "sync": "#E45756",
    "eval": "#B279A2",
    "wait": "#C9C3BF",
    OTHER: "#72B7B2",
}
_HEIGHTS = (0.8, 0.5, 0.3, 0.2)  # bar height by nesting depth


def render_gantt(trace: str | Path | Iterable[dict[str, Any]], png_path: str | Path, title: str | None = None) -> Path:
    """Draw ``trace`` (a Chrome-trace file or its events) to ``png_path``; x axis in seconds from the start."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = read_chrome_trace(trace) if isinstance(trace, str | Path) else list(trace)
    rows, spans = resolve_spans(events)
    base = min((s.start_us for s in spans), default=0.0)
    index = {row: i for i, row in enumerate(rows)}
    bars, ticks = _layout(spans, index, base)

    fig = Figure(figsize=(12, min(40.0, 1.6 + 0.42 * max(len(rows), 1))), dpi=120)
    ax = fig.add_subplot()
    for (y, cat, depth), xranges in bars.items():
        h = _HEIGHTS[min(depth, len(_HEIGHTS) - 1)]
        color = CATEGORY_COLORS.get(cat, CATEGORY_COLORS[OTHER])
        edge = tuple(0.75 * c for c in to_rgb(color))  # darker edge keeps tiny spans saturated and visible
        ax.broken_barh(xranges, (y - h / 2, h), facecolors=color, edgecolors=edge, linewidth=0.4)
    if ticks:
        xs, ys = zip(*ticks, strict=True)
        ax.plot(xs, ys, linestyle="none", marker="|", markersize=12, color="black", label="_instants")
    _style_axes(ax, rows)
    present = {cat for _, cat, _ in bars}
    order = [c for c in CATEGORY_COLORS if c in present] + sorted(present - CATEGORY_COLORS.keys())
    handles = [Patch(color=CATEGORY_COLORS.get(c, CATEGORY_COLORS[OTHER]), label=c) for c in order]
    if handles:
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    if not spans:
        ax.text(0.5, 0.5, "no spans", transform=ax.transAxes, ha="center", va="center", color="grey")
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _layout(
    spans: list[Span], index: dict[tuple[str, str], int], base: float
) -> tuple[dict[tuple[int, str, int], list[tuple[float, float]]], list[tuple[float, int]]]:
    """Group bars as ``(row, category, depth) -> [(start_s, width_s)]``; instants as ``(t_s, row)``."""
    by_row: dict[int, list[Span]] = defaultdict(list)
    ticks: list[tuple[float, int]] = []
    for s in spans:
        if s.ph == "X":
            by_row[index[(s.process, s.lane)]].append(s)
        else:
            ticks.append(((s.start_us - base) / 1e6, index[(s.process, s.lane)]))
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    for y, row_spans in by_row.items():
        open_ends: list[float] = []  # end times of the spans enclosing the current one
        for s in sorted(row_spans, key=lambda s: (s.start_us, -s.end_us)):
            while open_ends and open_ends[-1] <= s.start_us:
                open_ends.pop()
            bars[(y, s.cat, len(open_ends))].append(((s.start_us - base) / 1e6, (s.end_us - s.start_us) / 1e6))
            open_ends.append(s.end_us)
    return dict(sorted(bars.items(), key=lambda kv: kv[0][2])), ticks


def _style_axes(ax: Any, rows: list[tuple[str, str]]) -> None:
    labels = [process if lane == "main" else f"{process} / {lane}" for process, lane in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)  # first row on top
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:  # separate processes
            ax.axhline(y - 0.5, color="#888888", linewidth=0.6)
    ax.set_xlim(left=0)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", linestyle=":", linewidth=0.6, alpha=0.7)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
