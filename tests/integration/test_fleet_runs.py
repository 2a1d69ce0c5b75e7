"""Runs with the ``fleet.*`` options on a tiny real model: weights by broadcast train exactly like
the synchronous loop at η = 0 (every step's engine weights were the trainer's, bit for bit), and
longest-predicted-first dispatch holds requests at the proxy and learns lengths on the live path,
and sends the predicted long tail to a dedicated replica;
replicas as Ray actors each load every version (received by broadcast, forwarded through Ray)."""

import json

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


def _run(model_dir, out, name, *overrides):
    short = ["rollout.max_new_tokens=8", "rollout.max_batch=4", "trainer.micro_batch_tokens=48", "run.steps=2"]
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *short, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, load_causal_lm(result.final_model_dir).state_dict()


def test_broadcast_weight_transfer_trains_like_sync(tiny_task_model, tmp_path, ray_cluster):
    sync_records, sync_weights = _run(tiny_task_model, tmp_path, "sync", "run.mode=sync", "run.backend=local")
    records, weights = _run(
        tiny_task_model, tmp_path, "broadcast", "run.mode=async", "run.backend=ray", "rollout.max_staleness=0",
        "fleet.weight_transfer=broadcast", "fleet.broadcast_backend=gloo",
    )  # fmt: skip
    keys = ("step", "loss", "grad_norm", "reward_mean", "trained_tokens")
    trains = [tuple(r[k] for k in keys) for r in records if r["kind"] == "train"]
    assert len(trains) == 2 and trains == [tuple(r[k] for k in keys) for r in sync_records if r["kind"] == "train"]
    for name, value in sync_weights.items():
        assert torch.equal(weights[name], value), name
    fingerprint = next(r for r in records if r["kind"] == "weights")
    assert fingerprint["engine_version"] == fingerprint["trainer_version"] == 2
    assert fingerprint["engine_checksum"] == fingerprint["trainer_checksum"]


@pytest.mark.parametrize("ranker", ["ridge", "model"])
def test_longest_first_dispatch_on_the_live_path(tiny_task_model, tmp_path, ranker):
    records, _ = _run(
        tiny_task_model, tmp_path, f"lpt_{ranker}", "run.mode=async", "run.backend=local", "fleet.lpt=true",
        f"fleet.length_ranker={ranker}",
    )  # fmt: skip
    assert len([r for r in records if r["kind"] == "train"]) == 2
    proxy = next(r for r in records if r["kind"] == "proxy")  # the LLMProxy's counters at the run's end
    # 16 samples in flight on 4 slots: most waited at the proxy; every finished one taught the ranker
    assert proxy["lpt_observed"] >= 32 and proxy["lpt_waiting"] == 0 and proxy["routed"] >= 32


def test_long_tail_replicas_on_the_live_path(tiny_task_model, tmp_path):
    records, _ = _run(
        tiny_task_model, tmp_path, "long_tail", "run.mode=async", "run.backend=local", "resources.rollout.replicas=2",
        "rollout.max_staleness=0", "run.steps=3", "fleet.lpt=true", "fleet.long_tail_replicas=1",
        "fleet.long_tail_max_batch=1",
    )  # fmt: skip
    assert len([r for r in records if r["kind"] == "train"]) == 3
    proxy = next(r for r in records if r["kind"] == "proxy")
    # step 1's requests meet an untrained ranker (one constant: no long tail); from step 2 on, the
    # ranker has seen lengths and its predicted long tail goes to the dedicated replica
    assert proxy["long_tail_replicas"] == 1 and proxy["long_tail_routed"] > 0 and proxy["lpt_waiting"] == 0
    with pytest.raises(ValueError, match="leave none"):
        _run(tiny_task_model, tmp_path, "too_many", "run.backend=local", "fleet.lpt=true", "fleet.long_tail_replicas=1")


@pytest.mark.scale  # two replica actors, a rollout worker and a trainer: 20–25 s on 2 cores
def test_replicas_as_ray_actors_train_and_hold_the_trainers_weights(tiny_task_model, tmp_path, ray_cluster):
    records, _ = _run(
        tiny_task_model, tmp_path, "actors", "run.mode=async", "run.backend=ray", "rollout.max_staleness=1",
        "resources.rollout.replicas=2", "resources.rollout.replica_actors=true", "fleet.weight_transfer=broadcast",
    )  # fmt: skip
    assert len([r for r in records if r["kind"] == "train"]) == 2
    weights = next(r for r in records if r["kind"] == "weights")  # both actors' checksums must agree
    assert weights["engine_version"] == weights["trainer_version"] == 2
    assert weights["engine_checksum"] == weights["trainer_checksum"]
    assert weights["engine_weight_updates"] == 4  # each of the 2 actors loaded versions 1 and 2
