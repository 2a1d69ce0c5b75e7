"""Span recording, Chrome-trace export/merge, trace summary numbers and the Gantt PNG."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from sluice.telemetry.gantt import render_gantt
from sluice.telemetry.trace import (
    SPAN_CATEGORIES,
    SpanRecorder,
    read_chrome_trace,
    resolve_spans,
    trace_summary,
    write_chrome_trace,
)

S = 1_000_000_000  # ns per second
T0 = 1_700_000_000 * S  # a realistic epoch start; summaries must not lose precision on it


def complete(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def test_span_nesting_durations_and_args() -> None:
    rec = SpanRecorder("trainer")
    with rec.span("train_step", step=3) as outer:
        time.sleep(0.002)
        with rec.span("train_microbatch", lane="main", mb=0):
            time.sleep(0.01)
        outer.set(tokens=128)
    step, mb = sorted(complete(rec.drain()), key=lambda e: e["ts"])
    assert (step["name"], step["cat"], step["args"]) == ("train_step", "train", {"step": 3, "tokens": 128})
    assert (mb["name"], mb["cat"], mb["args"]) == ("train_microbatch", "train", {"mb": 0})
    assert mb["dur"] >= 10_000 and step["dur"] >= mb["dur"] + 2_000  # µs
    assert step["ts"] <= mb["ts"] and mb["ts"] + mb["dur"] <= step["ts"] + step["dur"]
    assert abs(step["ts"] / 1e6 - time.time()) < 60  # wall clock, comparable across processes
    assert step["pid"] == mb["pid"] and step["tid"] == mb["tid"]


def test_span_in_async_code_records_error_and_reraises() -> None:
    rec = SpanRecorder("rollout-0")

    async def worker(i: int) -> None:
        with rec.span("generate", lane=f"req{i}"):
            await asyncio.sleep(0.005)

    async def main() -> None:
        await asyncio.gather(worker(0), worker(1))

    asyncio.run(main())
    with pytest.raises(ValueError), rec.span("reward"):
        raise ValueError("boom")
    events = complete(rec.drain())
    assert sorted(e["name"] for e in events) == ["generate", "generate", "reward"]
    assert all(e["dur"] >= 4_000 for e in events if e["name"] == "generate")
    assert next(e for e in events if e["name"] == "reward")["args"] == {"error": "ValueError"}


def test_drain_clears_and_carries_metadata() -> None:
    rec = SpanRecorder("reward")
    rec.add("reward", T0, T0 + S, lane="judge")
    rec.instant("weights_published", version=2)
    assert rec.events() == rec.events()  # events() does not clear
    batch = rec.drain()
    assert rec.drain() == []
    meta = {(e["name"], e["args"]["name"]) for e in batch if e["ph"] == "M"}
    assert meta == {("process_name", "reward"), ("thread_name", "judge"), ("thread_name", "main")}
    instant = next(e for e in batch if e["ph"] == "i")
    assert instant["args"] == {"version": 2} and instant["cat"] == "other"
    json.dumps(batch)  # plain, JSON-able dicts for shipping from a Ray actor


def test_disabled_recorder_records_nothing() -> None:
    rec = SpanRecorder("trainer", enabled=False)
    with rec.span("train_step", step=1) as s:
        s.set(tokens=3)
    rec.add("generate", T0, T0 + S)
    rec.instant("x")
    assert rec.drain() == [] and rec.events() == []


def test_categories() -> None:
    assert SPAN_CATEGORIES["optimizer_step"] == "train" and SPAN_CATEGORIES["stale_wait"] == "wait"
    rec = SpanRecorder("p")
    for name in ("generate", "weight_sync", "eval", "prefill", "mystery"):
        rec.add(name, T0, T0 + 1)
    cats = {e["name"]: e["cat"] for e in complete(rec.drain())}
    assert cats == {
        "generate": "generate",
        "weight_sync": "sync",
        "eval": "eval",
        "prefill": "generate",
        "mystery": "other",
    }


def test_merged_export_is_valid_chrome_trace(tmp_path) -> None:
    trainer, rollout = SpanRecorder("trainer"), SpanRecorder("rollout-0")
    rollout.add("generate", T0 + 2 * S, T0 + 5 * S, lane="engine")
    trainer.add("train_step", T0 + 3 * S, T0 + 4 * S)
    trainer.add("weight_sync", T0 + 4 * S, T0 + 4 * S + S // 2, lane="sync")
    first = rollout.drain()
    rollout.add("generate", T0 + 6 * S, T0 + 7 * S, lane="engine")
    path = write_chrome_trace(tmp_path / "t" / "trace.json", [trainer, first, rollout.drain()])

    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms" and read_chrome_trace(path) == data["traceEvents"]
    events = data["traceEvents"]
    names = {(e["name"], e["pid"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert names[("process_name", 1, 0)] == {"name": "trainer"}
    assert names[("process_name", 2, 0)] == {"name": "rollout-0"}
    assert names[("thread_name", 1, 1)] == {"name": "main"} and names[("thread_name", 1, 2)] == {"name": "sync"}
    assert names[("thread_name", 2, 1)] == {"name": "engine"}
    spans = complete(events)
    for e in spans:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
    got = [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in spans]
    assert got == [
        ("generate", 2, 1, 0.0, 3e6),
        ("train_step", 1, 1, 1e6, 1e6),
        ("weight_sync", 1, 2, 2e6, 5e5),
        ("generate", 2, 1, 4e6, 1e6),
    ]
    assert len(resolve_spans(events)[1]) == 4


def synthetic_events() -> list[dict]:
    """10 s wall; trainer trains 0-3 and 5-8 (nested microbatches), syncs 8-9; rollout generates 1-6."""
    trainer, rollout = SpanRecorder("trainer"), SpanRecorder("rollout-0")
    trainer.add("train_step", T0, T0 + 3 * S)
    trainer.add("train_microbatch", T0, T0 + S)  # nested: not double counted
    trainer.add("train_microbatch", T0 + 5 * S, T0 + 8 * S)
    trainer.add("weight_sync", T0 + 8 * S, T0 + 9 * S)
    trainer.add("wait_data", T0 + 3 * S, T0 + 4 * S, lane="io")
    rollout.add("generate", T0 + S, T0 + 6 * S)
    rollout.add("wait_weights", T0 + 8 * S, T0 + 10 * S)
    rollout.instant("weights_loaded")
    return trainer.drain() + rollout.drain()


def test_summary_numbers_exact(tmp_path) -> None:
    events = synthetic_events()
    for evs in (events, read_chrome_trace(write_chrome_trace(tmp_path / "trace.json", [events]))):
        summary = trace_summary(evs)
        assert summary["wall_s"] == pytest.approx(10.0, abs=1e-9)
        lanes = summary["lanes"]
        assert set(lanes) == {"trainer/main", "trainer/io", "rollout-0/main"}
        main = lanes["trainer/main"]
        assert main["busy_s"] == pytest.approx({"train": 6.0, "sync": 1.0}, abs=1e-9)
        assert main["active_s"] == pytest.approx(7.0, abs=1e-9)
        assert main["idle_fraction"] == pytest.approx(0.3, abs=1e-12)
        assert main["spans"] == 4
        assert lanes["trainer/io"]["busy_s"] == pytest.approx({"wait": 1.0}, abs=1e-9)
        assert lanes["rollout-0/main"]["busy_s"] == pytest.approx({"generate": 5.0, "wait": 2.0}, abs=1e-9)
        assert summary["trainer_idle_fraction"] == pytest.approx(0.4, abs=1e-12)
        assert summary["generate_train_overlap_fraction"] == pytest.approx(0.3, abs=1e-12)  # 1-3 and 5-6
    assert trace_summary([])["lanes"] == {}
    assert trace_summary(events, trainer_process="learner")["trainer_idle_fraction"] is None


def test_render_gantt_writes_png(tmp_path) -> None:
    events = synthetic_events()
    trace = write_chrome_trace(tmp_path / "trace.json", [events])
    png = render_gantt(trace, tmp_path / "out" / "gantt.png", title="synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    assert render_gantt(events, tmp_path / "direct.png").read_bytes()[:4] == b"\x89PNG"
    assert render_gantt([], tmp_path / "empty.png").stat().st_size > 0
