"""The hand-written loop of ``examples/python_api`` (AsyncFlow's verbs) trains what ``fit()`` trains."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).parents[2] / "examples" / "python_api" / "hand_loop.py"
SAME = ["run.mode=async", "rollout.max_staleness=0", "run.backend=local", "rollout.max_new_tokens=12"]


def _hand_loop():
    spec = importlib.util.spec_from_file_location("hand_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train_by_hand


def test_the_verbs_by_hand_equal_fit_at_eta_zero(tiny_task_model, tmp_path):
    config = load_config(None, [*tiny_run_overrides(tiny_task_model, tmp_path, "fit"), *SAME])
    result = RLTrainer(config, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    fitted = [(r["loss"], r["grad_norm"], r["trained_tokens"]) for r in records if r["kind"] == "train"]

    trainer = RLTrainer(config, reward=length_reward)
    by_hand = _hand_loop()(trainer, config.run.steps, tmp_path / "by_hand")
    assert [(m["loss"], m["grad_norm"], m["trained_tokens"]) for m in by_hand] == fitted
    assert not trainer.discarded
    want = load_causal_lm(result.final_model_dir).state_dict()
    got = load_causal_lm(tmp_path / "by_hand").state_dict()
    assert all(torch.equal(got[name], value) for name, value in want.items())
    for folder in (result.final_model_dir, tmp_path / "by_hand"):  # what from_pretrained needs, no optimizer
        assert sorted(p.name for p in folder.iterdir() if p.suffix in (".pt", ".safetensors")) == ["model.safetensors"]


def test_fit_takes_a_closure_as_its_reward_with_the_default_pool(tiny_task_model, tmp_path):
    """TRL users' habit: the reward is a closure over the script's own variables. With the default
    reward pool (processes) it reaches them by value; every step scores with it, none fails."""
    cap = 6

    def shorter_is_better(response, **_):
        return len(response) <= cap  # a bool, as ``pred == gt`` rewards are

    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "closure"), "run.steps=2", "run.backend=local"]
    config = load_config(None, [*overrides, "run.eval_every=0"])
    assert config.reward.pool_size > 0
    result = RLTrainer(config, reward=shorter_is_better).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in train)
    rewards = next(r for r in records if r["kind"] == "rewards")
    assert not [k for k in rewards if "error" in k or "invalid" in k], rewards
