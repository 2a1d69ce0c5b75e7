"""``rollout.forced_lag`` on the real local pipeline: one engine slot group at a time (so queued
groups would otherwise start on newer weights), yet every warm step trains samples exactly η
versions old, and the per-sample histogram in ``metrics.jsonl`` says so."""

import json

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


def test_forced_lag_concentrates_sample_staleness_at_eta(tiny_task_model, tmp_path):
    overrides = [
        *tiny_run_overrides(tiny_task_model, tmp_path, "forced"),
        "run.mode=async",
        "run.backend=local",
        "run.steps=5",
        "rollout.max_staleness=2",
        "rollout.forced_lag=true",
        "rollout.max_new_tokens=8",
        "rollout.max_batch=4",
    ]
    result = RLTrainer(load_config(None, overrides), reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["sample_staleness_mean"] for r in trains] == [0.0, 1.0, 2.0, 2.0, 2.0]
    fates = next(r for r in records if r["kind"] == "fates")
    samples = {k: v for k, v in fates.items() if k.startswith("sample_staleness_")}
    assert samples == {"sample_staleness_0": 16.0, "sample_staleness_1": 16.0, "sample_staleness_2": 48.0}
