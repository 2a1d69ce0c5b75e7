"""A reward that fails on some prompts discards their groups, counted per reason, and the run goes on."""

import json

import pytest

from fakes import FaultyReward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("mode", "backend", "kind"),
    [("raise", "local", "error"), ("nan", "local", "invalid"), ("raise", "sync", "error")],
)
def test_failed_rewards_discard_their_groups_and_the_run_goes_on(tiny_task_model, tmp_path, mode, backend, kind):
    run = ["run.mode=sync", "run.backend=local"] if backend == "sync" else ["run.mode=async", f"run.backend={backend}"]
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, f"faulty_{backend}"), "rollout.max_new_tokens=8", *run]
    result = RLTrainer(load_config(None, overrides), reward=FaultyReward(mode)).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    fates = next(r for r in records if r["kind"] == "fates")
    rewards = next(r for r in records if r["kind"] == "rewards")
    reason = f"reward_{kind}:FaultyReward"
    assert result.steps == 3
    assert fates[f"discarded_{reason}"] >= 4  # ~30 % of prompts are long: whole groups of 4 dropped
    assert fates[f"discarded_{reason}"] % 4 == 0
    assert rewards[reason] >= fates[f"discarded_{reason}"]  # counted per call by the reward service
    if backend != "sync":  # async admission replaces discarded groups: every step still gets B
        assert fates["groups_trained"] == 12
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["reward_mean"] == r["reward_mean"] for r in train)  # no NaN reached the trainer
