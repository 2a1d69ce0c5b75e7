"""Algorithm options end to end on the tiny task model: PPO mini-batches with recomputed proximal
log-probs, a KL to the reference policy (the reference step as a queue task) and an entropy
bonus, in sync mode and on the asynchronous pipeline."""

import json

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

OPTIONS = [
    "trainer.ppo_mini_batches=2",
    "trainer.prox_logprobs=recompute",
    "trainer.kl_coef=0.05",
    "trainer.entropy_coef=0.01",
    "rollout.max_new_tokens=12",
    "run.eval_every=0",
]


def _train_records(model_dir, out, name, *overrides):
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *OPTIONS, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.parametrize("mode", ["sync", "local", "ray"])
def test_kl_entropy_and_mini_batches_run_end_to_end(tiny_task_model, tmp_path, mode, request):
    if mode == "ray":
        request.getfixturevalue("ray_cluster")
    where = ["run.mode=sync"] if mode == "sync" else ["run.mode=async", f"run.backend={mode}"]
    records = _train_records(tiny_task_model, tmp_path, mode, *where)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["optimizer_steps"] == 2 and r["entropy_sum"] > 0 for r in records)
    # every trained token had its reference log-prob; the policy leaves the reference once it moves
    assert all(r["kl_ref_sum"] >= 0 for r in records) and records[-1]["kl_ref_sum"] > 0
