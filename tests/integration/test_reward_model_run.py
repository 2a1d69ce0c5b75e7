"""``reward.model`` in a run: a scalar reward model scores every group before its filters, its
score combines with the rule reward, every record and ``samples.jsonl`` row carries it, its
scores are a direct ``transformers`` forward; 2 worker actors score what 1 does, a killed worker
is replaced; a bad folder is refused at start in one line."""

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from sluice import RLTrainer
from sluice.cli import main
from sluice.config import load_config
from sluice.engines.hf_model import load_tokenizer
from sluice.rewards.reward_model import RewardModelPool, RewardModelSpec, rm_input_ids
from tiny import save_tiny_reward_model, tiny_run_overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reward_model(tiny_task_model, tmp_path_factory):
    return save_tiny_reward_model(tiny_task_model, tmp_path_factory.mktemp("rm") / "rm")


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _direct(reward_model, prompt, response):
    model = AutoModelForSequenceClassification.from_pretrained(reward_model)
    ids = rm_input_ids(load_tokenizer(reward_model), prompt, response, templated=False)
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


@pytest.mark.parametrize("combine", ["sum", "model"])
def test_run_scores_groups_with_the_reward_model(tiny_task_model, reward_model, tmp_path, combine):
    overrides = [
        *tiny_run_overrides(tiny_task_model, tmp_path, combine), "run.steps=2", "rollout.max_new_tokens=12",
        "reward.pool_size=0", "task.eval_prompts=4", f"reward.model={reward_model}", f"reward.combine={combine}",
        "reward.model_weight=0.5", "reward.model_token_budget=64", "tracking.samples_every=1",
        "tracking.samples_per_step=4", "run.mode=sync", "run.backend=local",
    ]  # fmt: skip
    run_dir = RLTrainer(load_config(None, overrides)).fit().run_dir
    records = _jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all("rm_score_mean" in r for r in train)
    rewards = [r for r in records if r["kind"] == "rewards"][-1]
    assert rewards["rm_rows"] >= 2 * 4 * 4 and rewards["rm_batches"] >= 1
    samples = _jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 8
    for row in samples:
        prompt = row["prompt"].removeprefix("<bos>")  # samples.jsonl keeps the prompt's special tokens
        assert row["rm_score"] == pytest.approx(_direct(reward_model, prompt, row["response"]), abs=1e-4)
        rule = float(row["response"] == prompt.removesuffix(">")[::-1]) if combine == "sum" else 0.0
        assert row["reward"] == pytest.approx(rule + 0.5 * row["rm_score"], abs=1e-6)


TEXTS = [[(f"{k}{k + 1}{k + 2}>", f"{r}") for r in ("1", "22", "333", "-4444")] for k in range(6)]


async def _score(pool):
    return await asyncio.gather(*(pool.score(group) for group in TEXTS))


def test_two_worker_actors_score_as_one(reward_model, ray_cluster):
    expected = asyncio.run(_score(RewardModelPool(RewardModelSpec(str(reward_model), token_budget=64))))
    two = RewardModelPool(RewardModelSpec(str(reward_model), token_budget=64, workers=2, actors=True))
    try:
        assert asyncio.run(_score(two)) == [pytest.approx(g, abs=1e-5) for g in expected]
        assert two.counts["rm_batches"] >= 2  # both workers took batches
    finally:
        two.close()


@pytest.mark.faults
def test_a_killed_worker_actor_is_replaced(reward_model, ray_cluster):
    """SIGKILL-like ``ray.kill`` of the only worker: the next batch starts a fresh actor and runs
    again on it (counted); the scores are the same."""
    pool = RewardModelPool(RewardModelSpec(str(reward_model), token_budget=64, actors=True))
    try:
        expected = asyncio.run(_score(pool))
        ray_cluster.kill(pool.workers[0])
        assert asyncio.run(_score(pool)) == [pytest.approx(g, abs=1e-6) for g in expected]
        assert pool.counts["rm_worker_restarts"] == 1 and pool.counts["rm_retries"] == 1
        assert "reward_error:reward_model" not in pool.counts
    finally:
        pool.close()


def test_a_bad_reward_model_is_refused_at_start(tiny_task_model, tmp_path, capsys):
    base = tiny_run_overrides(tiny_task_model, tmp_path, "bad")
    assert main(["train", *base, f"reward.model={tmp_path}/nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("does not exist (expected a local Hugging Face model folder)") and "reward.model:" in err
    assert len(err.splitlines()) == 1
    assert main(["train", *base, f"reward.model={tiny_task_model}"]) == 2  # a causal LM: the wrong head
    err = capsys.readouterr().err.strip()
    assert "reward.model:" in err and "is not a scalar reward model" in err and len(err.splitlines()) == 1
    assert main(["train", *base, "reward.combine=model"]) == 2
    assert "set reward.model" in capsys.readouterr().err
    assert main(["train", *base, "task.name=calculator", f"reward.model={tiny_task_model}"]) == 2  # multi-turn
    err = capsys.readouterr().err.strip()
    assert err == "error: reward.model: single-turn rollouts only (an environment or agent scores its episodes)"


def test_run_with_an_llm_judge(tiny_task_model, tmp_path):
    """``reward.judge`` in the reward model's place: every trained group judged, the judge's calls
    and unreadable answers counted in the ``rewards`` record."""
    overrides = [
        *tiny_run_overrides(tiny_task_model, tmp_path, "judge"), "run.steps=2", "rollout.max_new_tokens=8",
        "reward.pool_size=0", "task.eval_prompts=4", f"reward.judge={tiny_task_model}",
        "reward.judge_template={prompt}{response}", "reward.judge_max_new_tokens=3", "run.mode=sync",
        "run.backend=local", "run.failure_budget=1.0",
    ]  # fmt: skip
    run_dir = RLTrainer(load_config(None, overrides)).fit().run_dir
    records = _jsonl(run_dir / "metrics.jsonl")
    assert all("rm_score_mean" in r for r in records if r["kind"] == "train")
    rewards = [r for r in records if r["kind"] == "rewards"][-1]
    assert rewards["judge_calls"] >= 2 * 4 * 4 and "judge_garbage" in rewards
