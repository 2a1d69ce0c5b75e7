"""A resumed ``fleet.rebalance`` run starts with the replicas its checkpoint kept, not the
config's count: two replicas at full speed beside a trainer of 8 PPO epochs a step leave the
trainer the bottleneck, so the rule removes one after step 2 (step 1 is start-up); the
checkpoint of step 2 records one replica and the resumed run shrinks its rollout to it before
its first step (which the rule does not judge: without the restore it would end with two).
Scale tier: two runs, about 30 s on the loaded machine."""

import json

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.controller.resume import read_driver_state
from tiny import tiny_run_overrides

pytestmark = [pytest.mark.integration, pytest.mark.scale]


def _fit(model, tmp_path, *extra: str):
    overrides = [
        *tiny_run_overrides(model, tmp_path, "resized"),
        "rollout.max_new_tokens=3", "trainer.micro_batch_tokens=20", "trainer.ppo_epochs=8",
        "run.mode=async", "run.backend=local", "rollout.max_staleness=1", "run.eval_every=0",
        "run.checkpoint_every=2", "fleet.rebalance=true", "fleet.rebalance_window=1", "fleet.rebalance_cooldown=1",
        "resources.rollout.replicas=2", "resources.rollout.min_replicas=1", *extra,
    ]  # fmt: skip
    return RLTrainer(load_config(None, overrides), reward=length_reward).fit()


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_resumed_run_starts_with_the_replicas_rebalancing_left(tiny_task_model, tmp_path):
    first = _fit(tiny_task_model, tmp_path, "run.steps=2")
    removed = [e for e in _records(first.run_dir, "rebalance") if e["change"] < 0]
    assert removed and removed[0]["replicas"] == 1, _records(first.run_dir, "rebalance")
    assert read_driver_state(first.run_dir / "checkpoints" / "step_000002").rollout_replicas == 1
    resumed = _fit(tiny_task_model, tmp_path, "run.steps=3", "run.resume=auto")
    proxy = _records(resumed.run_dir, "proxy")[-1]  # the resumed run's (the first run's is cut with the logs)
    assert proxy["replicas"] == 1 and proxy["replicas_removed"] >= 1 and proxy.get("replicas_added", 0) == 0
