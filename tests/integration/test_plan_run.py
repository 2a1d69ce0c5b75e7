"""A plan a run can take: ``sluice plan --device cpu ... --out plan.yaml``, then the run's own
config and the plan merged in order train as the plan says (issue: seed mechanisms in train)."""

import json

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.cli import main
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


def test_sluice_train_runs_the_plan_it_is_given(tiny_task_model, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    args = ["plan", "--model", "tiny", "--device", "cpu", "--devices", "2", "--batch", "4", "--group-size", "2",
            "--max-new-tokens", "12", "--median-len", "6", "--steps", "2", "--replica-sizes", "1",
            "--micro-batch-tokens", "48", "--out", str(plan)]  # fmt: skip
    assert main(args) == 0 and "wrote" in capsys.readouterr().out
    mine = tmp_path / "my_run.yaml"
    mine.write_text("run:\n  backend: local\n  steps: 2\n")
    overrides = [
        o
        for o in tiny_run_overrides(tiny_task_model, tmp_path, "planned")
        if not o.startswith(("rollout.", "run.steps"))
    ]
    cfg = load_config([mine, plan], overrides)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.trainer.micro_batch_tokens) == (4, 2, 48)
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2] and all(r["staleness_max"] <= 1 for r in trains)
    assert next(r for r in records if r["kind"] == "fates")["groups_trained"] == 8  # the plan's 4 per step
