"""Timeline tracing: workers record wall-clock spans, the driver merges them into one Chrome trace.

Each process (rollout worker, reward, trainer, controller) owns a ``SpanRecorder``. Spans use
``time.time_ns`` so spans from different processes line up on one time axis; a Ray actor ships
``rec.drain()`` (plain dicts) to the driver, which calls ``write_chrome_trace`` to get a file that
Perfetto / ``chrome://tracing`` opens, and ``trace_summary`` for numbers such as trainer idle time.

Drained events carry pid/tid as stable hashes of the process and lane names, so batches from many
processes can simply be concatenated; ``write_chrome_trace`` renumbers them to small ints.

A recorder may be capped (``max_events``, ``run.trace_max_events`` in a run): a ring buffer keeps
its newest events, so a long run's memory and ``trace.json`` stay bounded. What it drops is
counted and said: a ``trace_dropped`` metadata event per process (count, and the end of the newest
dropped span), shown in the viewer as a process label. A capped trace's numbers
(``trace_summary``, ``trace_numbers``) cover its complete window only: from the newest dropped
span's end, the time after which every recorder kept every span, to the last span.

It deliberately does not: sample or aggregate (every span is kept until drained or pushed out by
the cap), talk to Ray, correct clock skew between hosts, or draw anything (``telemetry/gantt.py``
renders the figure).
Concurrent spans in one lane (e.g. many coroutines) overlap in the viewer; give them their own lanes.
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

# Span name -> category; the category picks the colour in the Gantt chart and the bucket in summaries.
SPAN_CATEGORIES: dict[str, str] = {
    "generate": "generate",
    "prefill": "generate",
    "decode": "generate",
    "reward": "reward",
    "train_step": "train",
    "train_microbatch": "train",
    "optimizer_step": "train",
    "weight_sync": "sync",
    "weight_load": "sync",
    "weight_publish": "sync",
    "weight_fetch": "sync",
    "wait_weights": "wait",
    "wait_data": "wait",
    "stale_wait": "wait",
    "eval": "eval",
}
OTHER = "other"
DROPPED = "trace_dropped"  # metadata of a capped recorder: args dropped, until_us (newest dropped end), max_events
_Raw = tuple[str, str, int, int | None, dict[str, Any]]  # name, lane, start_ns, end_ns (None: instant), args


def _stable_id(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class _Span:
    """An open span; ``set(**args)`` attaches values known only at the end (e.g. token counts)."""

    __slots__ = ("args", "lane", "name", "rec", "start")

    def __init__(self, rec: SpanRecorder, name: str, lane: str, args: dict[str, Any]) -> None:
        self.rec, self.name, self.lane, self.args, self.start = rec, name, lane, args, 0

    def set(self, **args: Any) -> None:
        self.args.update(args)

    def __enter__(self) -> _Span:
        self.start = time.time_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        end = time.time_ns()
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        self.rec._record((self.name, self.lane, self.start, end, self.args))


class _NullSpan:
    __slots__ = ()

    def set(self, **args: Any) -> None:
        pass

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_NULL_SPAN = _NullSpan()


class SpanRecorder:
    """Per-process span buffer: ``with rec.span("generate", lane="engine0", n=8): ...``; ``rec.drain()``.

    ``max_events``: keep only the newest this many events between drains (``None``: all), the
    older ones counted in ``dropped``.
    """

    def __init__(self, process: str, enabled: bool = True, max_events: int | None = None) -> None:
        if max_events is not None and max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        self.process = process
        self.enabled = enabled
        self.pid = _stable_id(process)
        self._raw: deque[_Raw] = deque(maxlen=max_events)
        self.dropped = 0
        """Events pushed out by the cap since the last drain."""
        self._dropped_until = 0
        """End (ns) of the newest dropped event: every event ending later is still held."""

    @property
    def max_events(self) -> int | None:
        """The cap (``None``: none); a recorder replacing this one (a renamed rank) takes it over."""
        return self._raw.maxlen

    def _record(self, event: _Raw) -> None:
        raw = self._raw
        if len(raw) == raw.maxlen:  # the oldest event makes room
            _, _, start, end, _ = raw[0]
            self.dropped += 1
            self._dropped_until = max(self._dropped_until, start if end is None else end)
        raw.append(event)

    def span(self, name: str, lane: str = "main", **args: Any) -> _Span | _NullSpan:
        """Context manager measuring the wall time of its body; safe inside ``async def``."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, lane, args)

    def add(self, name: str, start_ns: int, end_ns: int, lane: str = "main", **args: Any) -> None:
        """Record a span measured elsewhere (``time.time_ns`` values)."""
        if self.enabled:
            self._record((name, lane, start_ns, end_ns, args))

    def instant(self, name: str, lane: str = "main", **args: Any) -> None:
        """Record a point event (e.g. "weights_published", version=3)."""
        if self.enabled:
            self._record((name, lane, time.time_ns(), None, args))

    def events(self) -> list[dict[str, Any]]:
        """The recorded events as Chrome-trace dicts (with metadata), without clearing them."""
        return self._to_events(list(self._raw), self.dropped, self._dropped_until)

    def drain(self) -> list[dict[str, Any]]:
        """Return the recorded events (see ``events``) and clear the buffer and the drop count."""
        raw, dropped, until = list(self._raw), self.dropped, self._dropped_until
        self._raw.clear()
        self.dropped = self._dropped_until = 0
        return self._to_events(raw, dropped, until)

    def _to_events(self, raw: list[_Raw], dropped: int, until_ns: int) -> list[dict[str, Any]]:
        if not raw:
            return []
        pid = self.pid
        tids: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        for name, lane, start, end, args in raw:
            tid = tids[lane] if lane in tids else tids.setdefault(lane, _stable_id(lane))
            ph = "i" if end is None else "X"
            event = {"name": name, "cat": SPAN_CATEGORIES.get(name, OTHER), "ph": ph, "ts": start / 1000}
            event.update(pid=pid, tid=tid, args=args)
            if end is None:
                event["s"] = "t"
            else:
                event["dur"] = (end - start) / 1000
            out.append(event)
        meta = [_meta("process_name", pid, 0, name=self.process)]
        meta += [_meta("thread_name", pid, tid, name=lane) for lane, tid in tids.items()]
        if dropped:
            meta.append(_meta(DROPPED, pid, 0, dropped=dropped, until_us=until_ns / 1000, max_events=self.max_events))
        return meta + out


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    """Metadata event: ``process_name`` / ``thread_name`` (``name=``) or ``*_sort_index`` (``sort_index=``)."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _flatten(sources: Iterable[Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for source in sources:
        if isinstance(source, SpanRecorder):
            events += source.events()
        elif isinstance(source, dict):
            events.append(source)
        else:
            events += source
    return events


class Span(NamedTuple):
    """A span or instant with its process and lane names resolved; ``end_us == start_us`` for instants."""

    process: str
    lane: str
    name: str
    cat: str
    start_us: float
    end_us: float
    ph: str
    args: dict[str, Any]


def resolve_spans(events: Iterable[dict[str, Any]]) -> tuple[list[tuple[str, str]], list[Span]]:
    """Rows ``(process, lane)``: processes in first-seen order, lanes sorted; and the spans/instants."""
    events = list(events)
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    order: dict[str, dict[str, None]] = {}
    spans: list[Span] = []
    for e in events:
        ph = e.get("ph")
        if ph not in ("X", "i", "I") and not (ph == "M" and e.get("name") == "thread_name"):
            continue
        process = procs.get(e["pid"], str(e["pid"]))
        lane = lanes.get((e["pid"], e["tid"]), str(e["tid"]))
        order.setdefault(process, {})[lane] = None
        if ph != "M":
            start = float(e["ts"])
            end = start + e.get("dur", 0.0)
            spans.append(Span(process, lane, e["name"], e.get("cat", OTHER), start, end, ph, e.get("args", {})))
    rows = [(process, lane) for process, ls in order.items() for lane in sorted(ls, key=_lane_key)]
    return rows, spans


def _lane_key(lane: str) -> tuple[bool, list[str | int]]:
    """ "main" first, then natural order (engine2 before engine10)."""
    return lane != "main", [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", lane)]


def write_chrome_trace(path: str | Path, sources: Iterable[Any]) -> Path:
    """Merge recorders, drained batches or single events into one Chrome-trace JSON file.

    ``sources`` items may be ``SpanRecorder`` (read, not drained), event dicts, or lists of event
    dicts. Processes and lanes get small pid/tid ints in first-seen order; timestamps are rebased
    so the earliest event is at 0. A process whose recorder dropped events keeps one
    ``trace_dropped`` event (the counts summed) and a ``process_labels`` line saying so.
    """
    events = _flatten(sources)
    rows, spans = resolve_spans(events)
    base = min((s.start_us for s in spans), default=0.0)
    drops = _drops_by_process(events)
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    meta: list[dict[str, Any]] = []
    for process, lane in rows:
        if process not in pids:
            pid = pids[process] = len(pids) + 1
            meta += [_meta("process_name", pid, 0, name=process), _meta("process_sort_index", pid, 0, sort_index=pid)]
            if process in drops:
                dropped, until, cap = drops[process]
                label = f"capped at {cap} events: the oldest {dropped} dropped"
                meta += [_meta("process_labels", pid, 0, labels=label)]
                meta += [_meta(DROPPED, pid, 0, dropped=dropped, until_us=round(until - base, 3), max_events=cap)]
        pid, tid = pids[process], 1 + sum(p == process for p, _ in tids)
        tids[(process, lane)] = tid
        meta += [_meta("thread_name", pid, tid, name=lane), _meta("thread_sort_index", pid, tid, sort_index=tid)]
    body = [_export(s, pids[s.process], tids[(s.process, s.lane)], base) for s in spans]
    body.sort(key=lambda e: e["ts"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": meta + body, "displayTimeUnit": "ms"}, default=str))
    return path


def _drops_by_process(events: list[dict[str, Any]]) -> dict[str, tuple[int, float, int]]:
    """Process name -> (events dropped, end of the newest dropped in µs, the cap), over every
    ``trace_dropped`` event of the process (several drained batches sum)."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    out: dict[str, tuple[int, float, int]] = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == DROPPED:
            process, args = procs.get(e["pid"], str(e["pid"])), e["args"]
            dropped, until, cap = out.get(process, (0, -math.inf, 0))
            out[process] = (dropped + args["dropped"], max(until, args["until_us"]), max(cap, args["max_events"]))
    return out


def complete_window(events: Iterable[dict[str, Any]]) -> tuple[int, float | None]:
    """(events dropped by capped recorders, the time in µs from which the trace holds every span:
    the end of the newest dropped one; ``None`` when nothing was dropped)."""
    drops = [e["args"] for e in events if e.get("ph") == "M" and e.get("name") == DROPPED]
    if not drops:
        return 0, None
    return sum(a["dropped"] for a in drops), max(a["until_us"] for a in drops)


def _clip(spans: list[Span], start_us: float) -> list[Span]:
    """The spans' parts at or after ``start_us`` (spans and instants wholly before it left out)."""
    kept = [s for s in spans if (s.end_us > start_us if s.ph == "X" else s.start_us >= start_us)]
    return [s._replace(start_us=max(s.start_us, start_us)) for s in kept]


def _export(s: Span, pid: int, tid: int, base: float) -> dict[str, Any]:
    event: dict[str, Any] = {"name": s.name, "cat": s.cat, "ph": s.ph, "ts": round(s.start_us - base, 3)}
    if s.ph == "X":
        event["dur"] = round(s.end_us - s.start_us, 3)
    else:
        event["s"] = "t"
    event.update(pid=pid, tid=tid, args=s.args)
    return event


def read_chrome_trace(path: str | Path) -> list[dict[str, Any]]:
    """Events of a trace file in either the object (``traceEvents``) or the bare-array form."""
    data = json.loads(Path(path).read_text())
    return list(data["traceEvents"] if isinstance(data, dict) else data)


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def trace_summary(events: Iterable[dict[str, Any]], trainer_process: str = "trainer") -> dict[str, Any]:
    """Per-lane busy seconds by category, wall span, idle fractions and generate/train overlap.

    Busy time is the union of a lane's spans (nested spans are not double counted). Returns
    ``{"wall_s", "lanes": {"process/lane": {"busy_s": {cat: s}, "active_s", "idle_fraction",
    "spans"}}, "trainer_idle_fraction", "generate_train_overlap_fraction"}``; fractions are of
    ``wall_s`` (first span start to last span end over all processes). ``trainer_idle_fraction`` is
    the share of wall time with no "train" span in any lane of ``trainer_process`` (None if absent);
    the overlap fraction is the share with a "generate" and a "train" span running at once, anywhere.
    A capped trace (``trace_dropped`` events) is summarised over its complete window only (the
    spans clipped to it), so no recorder's missing past reads as idle time.
    """
    events = list(events)
    rows, spans = resolve_spans(events)
    _, window = complete_window(events)
    if window is not None:
        spans = _clip(spans, window)
    by_row: dict[tuple[str, str], list[tuple[str, float, float]]] = {row: [] for row in rows}
    for s in spans:
        if s.ph == "X":
            by_row[(s.process, s.lane)].append((s.cat, s.start_us, s.end_us))
    done = [iv for ivs in by_row.values() for iv in ivs]
    if not done:
        return {"wall_s": 0.0, "lanes": {}, "trainer_idle_fraction": None, "generate_train_overlap_fraction": None}
    wall = max(e for _, _, e in done) - min(s for _, s, _ in done)
    lanes: dict[str, Any] = {}
    for (process, lane), ivs in by_row.items():
        if ivs:
            active = _union((s, e) for _, s, e in ivs)
            lanes[f"{process}/{lane}"] = {
                "busy_s": {
                    c: _union((s, e) for k, s, e in ivs if k == c) / 1e6 for c in sorted({k for k, _, _ in ivs})
                },
                "active_s": active / 1e6,
                "idle_fraction": _fraction(wall - active, wall),
                "spans": len(ivs),
            }
    trainer = [iv for (process, _), ivs in by_row.items() if process == trainer_process for iv in ivs]
    train_busy = _union((s, e) for k, s, e in trainer if k == "train")
    gen = [(s, e) for k, s, e in done if k == "generate"]
    train = [(s, e) for k, s, e in done if k == "train"]
    overlap = _union(gen) + _union(train) - _union(gen + train)
    return {
        "wall_s": wall / 1e6,
        "lanes": lanes,
        "trainer_idle_fraction": _fraction(wall - train_busy, wall) if trainer else None,
        "generate_train_overlap_fraction": _fraction(overlap, wall),
    }


def _fraction(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0  # an empty or instantaneous trace has nothing idle


def trace_numbers(events: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """The headline numbers of a run's trace, for ``metrics.jsonl`` and benchmarks.

    ``events``: the spans and instants held; ``dropped_events``: those the recorders' caps pushed
    out. With any dropped, ``wall_s`` and the fractions cover the complete window only (the newest
    part of the run: from the newest dropped span's end to the last span), not the whole run.
    """
    events = list(events)
    summary = trace_summary(events)
    dropped, _ = complete_window(events)
    return {
        "events": float(sum(e.get("ph") in ("X", "i", "I") for e in events)),
        "dropped_events": float(dropped),
        "wall_s": summary["wall_s"],
        "trainer_idle_fraction": summary.get("trainer_idle_fraction"),
        "generate_train_overlap_fraction": summary.get("generate_train_overlap_fraction"),
    }
