"""The synchronous loop end to end on a tiny real model: it learns, syncs, and is deterministic."""

import json

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


@pytest.fixture
def model_dir(tiny_task_model):
    return tiny_task_model


def _config(model_dir, out, name):
    overrides = ["rollout.max_new_tokens=8", "trainer.micro_batch_tokens=64", "run.mode=sync"]
    return load_config(None, [*tiny_run_overrides(model_dir, out, name), *overrides])


def _train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_sync_loop_learns_syncs_and_saves(model_dir, tmp_path):
    trainer = RLTrainer(_config(model_dir, tmp_path, "a"), reward=length_reward)
    trainer.init_engines()
    before = {k: v.clone() for k, v in trainer.train_engine.export_weights().items()}
    result = trainer.fit()

    assert result.steps == 3 and trainer.version == 3
    records = _train_records(result.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["micro_batches"] > 1 for r in records)  # 64-token budget splits each step
    assert any(abs(r["loss"]) > 0 for r in records)
    after = trainer.train_engine.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the weights"
    engine_state = trainer.engine.model.state_dict()
    for name, value in after.items():
        assert torch.equal(engine_state[name], value), f"engine weight {name} differs from the trainer's"
    assert {s.token_versions[0] for s in trainer.generate(trainer.admit(1))} == {3}

    assert (result.run_dir / "config.yaml").is_file()
    reloaded = load_causal_lm(result.final_model_dir).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in after.items())


def test_same_seed_same_run(model_dir, tmp_path):
    runs = []
    for name in ("x", "y"):
        trainer = RLTrainer(_config(model_dir, tmp_path, name), reward=length_reward)
        result = trainer.fit()
        runs.append([(r["reward_mean"], r["loss"], r["response_len_mean"]) for r in _train_records(result.run_dir)])
    assert runs[0] == runs[1]
