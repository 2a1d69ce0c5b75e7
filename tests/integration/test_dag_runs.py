"""DAG runs end to end on a tiny real model: the two-reward example DAG of ``examples/`` trains
through ``sluice.RLTrainer``, and its custom node's output reaches the step."""

import json
from pathlib import Path

import pytest

from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).parents[2] / "examples" / "dag_two_rewards"


def test_the_two_reward_example_dag_trains_end_to_end(tiny_task_model, tmp_path):
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "two"), "run.steps=2", "rollout.max_new_tokens=16"]
    overrides += ["run.backend=local"]  # the example's run.mode: async, every custom node a worker of its own
    cfg = load_config(EXAMPLE / "config.yaml", [*overrides, f"run.dag={EXAMPLE / 'dag.yaml'}"])
    trainer = RLTrainer(cfg)
    result = trainer.fit()
    assert result.steps == 2 and trainer.dag_plan.spec.name == "grpo_two_rewards"
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert len(steps) == 2 and all("total_reward_mean" in r for r in steps)
    # the length penalty (responses over 12 tokens) lowers the combined reward below the task's
    assert all(r["total_reward_mean"] <= r["reward_mean"] for r in steps)
    assert any(r["total_reward_mean"] < r["reward_mean"] for r in steps)
