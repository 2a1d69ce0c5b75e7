"""``run.mode: sync`` end to end on a tiny real model: it learns, syncs, never overlaps, and is deterministic."""

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


def _config(model_dir, out, name, *extra):
    overrides = ["rollout.max_new_tokens=8", "trainer.micro_batch_tokens=64", "run.mode=sync", "run.backend=local"]
    return load_config(None, [*tiny_run_overrides(model_dir, out, name), *overrides, *extra])


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _train_records(run_dir):
    return _records(run_dir, "train")


def test_sync_schedule_learns_syncs_saves_and_never_overlaps(model_dir, tmp_path):
    before = load_causal_lm(model_dir).state_dict()
    result = RLTrainer(_config(model_dir, tmp_path, "a"), reward=length_reward).fit()

    assert result.steps == 3
    records = _train_records(result.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["micro_batches"] > 1 for r in records)  # 64-token budget splits each step
    assert any(abs(r["loss"]) > 0 for r in records)
    # the barrier: every group generated before the step trained, the engines at v + 1 before the next
    assert all(r["trained_before_generated"] == 0.0 and r["staleness_max"] == 0 for r in records)
    assert [r["engine_version"] for r in records] == [1.0, 2.0, 3.0]
    weights = _records(result.run_dir, "weights")[0]
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == weights["trainer_checksum"]
    after = load_causal_lm(result.final_model_dir).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the weights"
    assert (result.run_dir / "config.yaml").is_file()
    assert _records(result.run_dir, "fates")[0]["groups_trained"] == 3 * 4


def test_same_seed_same_run(model_dir, tmp_path):
    runs = []
    for name in ("x", "y"):
        trainer = RLTrainer(_config(model_dir, tmp_path, name), reward=length_reward)
        result = trainer.fit()
        runs.append([(r["reward_mean"], r["loss"], r["response_len_mean"]) for r in _train_records(result.run_dir)])
    assert runs[0] == runs[1]


def test_sync_runs_the_async_options_on_the_same_workers(model_dir, tmp_path):
    """Two replicas behind the LLMProxy, and zero-signal groups discarded, counted and replaced."""
    extra = ["resources.rollout.replicas=2", "rollout.filter_groups=zero_signal", "run.steps=2"]
    result = RLTrainer(_config(model_dir, tmp_path, "opts", *extra), reward=length_reward).fit()
    fates = _records(result.run_dir, "fates")[0]
    assert fates["groups_trained"] == 2 * 4
    assert all(r["groups_with_signal"] == 1.0 for r in _train_records(result.run_dir))
    assert _records(result.run_dir, "weights")[0]["engine_proxy_routed"] > 0
