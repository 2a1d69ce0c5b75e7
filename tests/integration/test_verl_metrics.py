"""Every number a verl user compares (``docs/tracking.md``'s table) is in a real run's
``metrics.jsonl`` and its TensorBoard events: entropy without an entropy term, ``lr`` without a
schedule, the reward's mean / std / min / max and per ``data_source``, the clip ratio, the
response lengths and the share cut at the cap."""

import json

import pytest

from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

VERL_KEYS = ("entropy", "lr", "reward_mean", "reward_std", "reward_min", "reward_max", "clip_ratio",
             "response_len_mean", "response_len_max", "response_clip_ratio", "grad_norm", "loss")  # fmt: skip


def test_a_run_logs_the_numbers_a_verl_user_compares(tiny_task_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"prompt": f"{i}{i + 1}>", "answer": f"{i + 1}{i}", "data_source": ("a", "b")[i % 2]}) + "\n"
        for i in range(16)
    ))  # fmt: skip
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "verl"), "run.backend=local", "run.steps=2",
                 f"data.train_files={rows}", "rollout.max_new_tokens=6", "reward.name=exact_match",
                 "tracking.trackers=[tensorboard]"]  # fmt: skip
    result = RLTrainer(load_config(None, overrides)).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert len(trains) == 2
    for key in (*VERL_KEYS, "reward_mean/a", "reward_mean/b"):
        assert all(isinstance(r.get(key), int | float) for r in trains), key
    assert all(r["entropy"] > 0 and r["lr"] > 0 and r["response_len_max"] <= 6 for r in trains)
    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"train/{key}" for key in (*VERL_KEYS, "reward_mean/a", "reward_mean/b")} <= tags
