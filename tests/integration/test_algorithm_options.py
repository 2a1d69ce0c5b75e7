"""Algorithm options end to end on the tiny task model: PPO mini-batches with recomputed proximal
log-probs, a KL to the reference policy (the reference step as a queue task) and an entropy
bonus, in sync mode and on the asynchronous pipeline; LoRA; PPO with a critic."""

import json

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import ConfigError, load_config
from sluice.engines.hf_model import load_causal_lm
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


def test_lora_run_syncs_merged_weights_to_the_engine(tiny_task_model, tmp_path):
    overrides = ["trainer.lora_rank=4", "trainer.lr=3e-2", "run.mode=async", "run.backend=local"]
    cfg = load_config(None, [*tiny_run_overrides(tiny_task_model, tmp_path, "lora"), *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == pytest.approx(weights["trainer_checksum"], rel=1e-9)
    base = load_causal_lm(tiny_task_model).state_dict()
    final = load_causal_lm(result.final_model_dir).state_dict()  # a plain HF folder, adapters merged
    assert not torch.equal(
        final["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted


def test_ppo_with_a_critic_trains_in_sync_mode(tiny_task_model, tmp_path):
    overrides = ["trainer.algorithm=ppo", "trainer.ppo_mini_batches=2", "trainer.critic_lr=1e-2", "run.mode=sync"]
    records = _train_records(tiny_task_model, tmp_path, "ppo", *overrides)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["value_tokens"] > 0 and r["value_loss"] > 0 and r["optimizer_steps"] == 2 for r in records)
    assert records[0]["value_mean"] == 0.0 and records[-1]["value_mean"] != 0.0  # the critic learns
    with pytest.raises(ConfigError, match=r"run\.mode=sync"):
        RLTrainer(load_config(None, ["trainer.algorithm=ppo", "run.mode=async"]))
