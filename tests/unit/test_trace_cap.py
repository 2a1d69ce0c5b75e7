"""The capped trace: a recorder keeps its newest events, counts and labels what it dropped, and a
capped trace's numbers cover only the window every recorder kept whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import length_reward
from sluice.api import SamplingParams
from sluice.config import load_config
from sluice.runtime.pipelines import PipelineSpec, rollout_kwargs
from sluice.telemetry.trace import (
    DROPPED,
    SpanRecorder,
    complete_window,
    read_chrome_trace,
    trace_numbers,
    trace_summary,
    write_chrome_trace,
)

S = 1_000_000_000  # ns per second
T0 = 1_700_000_000 * S


def _spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] in ("X", "i")]


def test_a_capped_recorder_keeps_the_newest_events_and_counts_the_rest() -> None:
    rec = SpanRecorder("rollout", max_events=3)
    for k in range(10):
        rec.add("generate", T0 + k * S, T0 + (k + 1) * S, lane="engine0")
    assert len(_spans(rec.events())) == 3 and rec.dropped == 7  # events() reads, does not clear
    batch = rec.drain()
    assert [e["ts"] for e in _spans(batch)] == [(T0 + k * S) / 1000 for k in (7, 8, 9)]
    (dropped,) = [e for e in batch if e["ph"] == "M" and e["name"] == DROPPED]
    assert dropped["args"] == {"dropped": 7, "until_us": (T0 + 7 * S) / 1000, "max_events": 3}
    json.dumps(batch)
    rec.instant("weights_loaded")  # a drain starts the count afresh
    assert rec.dropped == 0 and not [e for e in rec.drain() if e["name"] == DROPPED]


def test_memory_stays_at_the_cap_over_a_long_run() -> None:
    rec = SpanRecorder("rollout", max_events=1_000)
    for k in range(50_000):
        with rec.span("generate", lane=f"engine{k % 4}", n=k):
            pass
    assert len(rec._raw) == 1_000 and rec.dropped == 49_000 and rec.max_events == 1_000
    assert len(_spans(rec.drain())) == 1_000
    unbounded = SpanRecorder("rollout")  # the default (simulations, tests): every event kept
    for k in range(5_000):
        unbounded.add("generate", T0 + k, T0 + k + 1)
    assert len(_spans(unbounded.drain())) == 5_000
    with pytest.raises(ValueError, match="max_events must be at least 1, got 0"):
        SpanRecorder("rollout", max_events=0)


def _capped_run() -> list[dict]:
    """Trainer (uncapped) trains 0-8.5 s and 9-9.5 s; the rollout (capped at 2) generates each
    second 0-10, keeping 8-9 and 9-10: the complete window is 8-10 s."""
    trainer, rollout = SpanRecorder("trainer"), SpanRecorder("rollout", max_events=2)
    trainer.add("train_step", T0, T0 + 17 * S // 2)
    trainer.add("train_step", T0 + 9 * S, T0 + 19 * S // 2)
    for k in range(10):
        rollout.add("generate", T0 + k * S, T0 + (k + 1) * S)
    return trainer.drain() + rollout.drain()


def test_a_capped_traces_numbers_cover_its_complete_window(tmp_path: Path) -> None:
    events = _capped_run()
    path = write_chrome_trace(tmp_path / "trace.json", [events[:3], events[3:]])
    for evs in (events, read_chrome_trace(path)):  # the same numbers from the file (rebased times)
        numbers = trace_numbers(evs)
        assert numbers["dropped_events"] == 8 and numbers["events"] == 4
        assert numbers["wall_s"] == pytest.approx(2.0, abs=1e-6)  # 8-10 s, not 0-10 s
        assert numbers["trainer_idle_fraction"] == pytest.approx(0.5, abs=1e-6)  # 8-8.5 and 9-9.5 of 8-10
        assert numbers["generate_train_overlap_fraction"] == pytest.approx(0.5, abs=1e-6)
        lanes = trace_summary(evs)["lanes"]
        assert lanes["trainer/main"]["spans"] == 2 and lanes["rollout/main"]["spans"] == 2
    assert complete_window(events) == (8, (T0 + 8 * S) / 1000)
    assert complete_window(read_chrome_trace(path)) == (8, pytest.approx(8e6))
    uncapped = trace_numbers([e for e in events if e["name"] != DROPPED])  # what the cap would misread
    assert uncapped["dropped_events"] == 0 and uncapped["wall_s"] == pytest.approx(10.0)


def test_the_written_trace_labels_the_capped_process_and_sums_its_batches(tmp_path: Path) -> None:
    rec = SpanRecorder("rollout", max_events=2)
    batches = []
    for part in range(2):  # two drains (e.g. the base evaluation, then the loop), 3 dropped each
        for k in range(5):
            rec.add("generate", T0 + (5 * part + k) * S, T0 + (5 * part + k + 1) * S)
        batches.append(rec.drain())
    events = read_chrome_trace(write_chrome_trace(tmp_path / "trace.json", batches))
    meta = {e["name"]: e["args"] for e in events if e["ph"] == "M" and e["pid"] == 1 and e["tid"] == 0}
    assert meta["process_labels"] == {"labels": "capped at 2 events: the oldest 6 dropped"}
    # the newest dropped ends at 8 s; the file's time 0 is its first kept span's start (3 s)
    assert meta[DROPPED] == {"dropped": 6, "until_us": 5e6, "max_events": 2}


def test_run_trace_max_events_caps_the_rollout_workers_recorder(tiny_task_model: Path) -> None:
    from sluice.rollout.worker import RolloutWorker

    config = load_config(None, ["reward.pool_size=0", "run.trace_max_events=3"])
    spec = PipelineSpec(config, tiny_task_model, length_reward, SamplingParams(max_new_tokens=4))
    worker = RolloutWorker(**rollout_kwargs(spec, None))
    try:
        for k in range(5):
            worker.tracer.instant("weights_loaded", version=k)
        batch = worker.drain_trace()
    finally:
        worker.close()
    assert [e["args"]["version"] for e in _spans(batch)] == [2, 3, 4]
    assert next(e for e in batch if e["name"] == DROPPED)["args"]["dropped"] == 2
