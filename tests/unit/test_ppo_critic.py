"""PPO with a critic: per-token rewards, GAE targets and whitening, the clipped value loss and the
value head, against plain-Python references; one whole step on tiny models; the critic-values
queue task (values independent of batching, never from a critic older than the row)."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from sluice.api import Sample
from sluice.config import TrainerConfig
from sluice.dag.node_worker import NodeTaskWorker
from sluice.dag.spec import load_dag
from sluice.engines.critic import CriticEngine, clipped_value_loss
from sluice.engines.hf_train import HFTrainEngine
from sluice.queue import LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS, samples_to_rows
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.ppo import (
    VALUES_COLUMN,
    CriticSpec,
    gae_targets,
    token_rewards,
    whiten,
)
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.sections import algorithm_of, critic_of, schedule_of
from sluice.trainer.updates import UpdateSchedule
from sluice.trainer.worker import TRAIN_TASK, TrainerWorker
from sluice.weights import InProcessWeightSync
from tiny import VOCAB, tiny_llama

torch.set_num_threads(1)


def _sample(uid: str, reward: float, n: int, mask=None, ref=(), seed: int = 0) -> Sample:
    rng = random.Random(seed)
    resp = tuple(rng.randrange(1, VOCAB) for _ in range(n))
    behav = tuple(-rng.uniform(0.5, 3.0) for _ in range(n))
    return Sample(uid, 0, (1, 2, 3), resp, behav, (0,) * n, mask or (1,) * n, reward, ref_logprobs=ref)


def test_token_rewards_put_the_reward_on_the_last_loss_token_and_shape_the_kl():
    s = _sample("a", 2.0, 4, mask=(1, 1, 0, 0))
    assert token_rewards(s, GRPOAlgorithm(estimator="gae")).tolist() == [0.0, 2.0, 0.0, 0.0]
    ref = (-1.0, -1.0, -1.0, -1.0)
    s = _sample("b", 1.0, 4, mask=(1, 0, 1, 1), ref=ref)
    algo = GRPOAlgorithm(estimator="gae", kl_coef=0.1, kl_estimator="k1", kl_in="reward")
    want = [-0.1 * (b - r) * m for b, r, m in zip(s.behav_logprobs, ref, s.loss_mask, strict=True)]
    want[3] += 1.0
    assert token_rewards(s, algo).tolist() == pytest.approx(want, abs=1e-12)


def test_gae_targets_match_a_plain_recursion_then_whitening():
    samples = [_sample("a", 1.0, 3, seed=1), _sample("b", 0.0, 2, mask=(1, 0), seed=2), _sample("c", 1.0, 4, seed=3)]
    values = [[0.1, 0.3, 0.5], [0.2, 0.9], [-0.1, 0.0, 0.4, 0.8]]
    gamma, lam = 0.9, 0.8
    want_adv, want_ret = [], []
    for s, v in zip(samples, values, strict=True):
        loss = [t for t, m in enumerate(s.loss_mask) if m]
        rewards = [0.0] * len(v)
        rewards[loss[-1]] = s.reward
        adv, ret = [0.0] * len(v), [0.0] * len(v)
        running, next_v = 0.0, 0.0
        for t in reversed(loss):
            running = rewards[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t], ret[t], next_v = running, running + v[t], v[t]
        want_adv.append(adv)
        want_ret.append(ret)
    flat = [a for row, s in zip(want_adv, samples, strict=True) for a, m in zip(row, s.loss_mask, strict=True) if m]
    mean = sum(flat) / len(flat)
    std = (sum((a - mean) ** 2 for a in flat) / len(flat)) ** 0.5
    adv, ret = gae_targets(samples, values, GRPOAlgorithm(estimator="gae"), gamma, lam)
    for row, want, s in zip(adv, want_adv, samples, strict=True):
        assert row == pytest.approx(
            [(a - mean) / (std + 1e-8) if m else 0.0 for a, m in zip(want, s.loss_mask, strict=True)]
        )
    assert ret == [pytest.approx(r) for r in want_ret]
    assert whiten([[1.0, 5.0]], [[0, 0]]) == [[0.0, 0.0]]


def test_clipped_value_loss_matches_the_formula():
    rng = random.Random(0)
    v, old, ret = ([rng.uniform(-1, 1) for _ in range(20)] for _ in range(3))
    mask = [rng.random() < 0.8 for _ in range(20)]
    clip = 0.2
    want, clipped = 0.0, 0
    for a, o, r, m in zip(v, old, ret, mask, strict=True):
        vc = o + max(-clip, min(clip, a - o))
        if m:
            want += 0.5 * max((a - r) ** 2, (vc - r) ** 2)
            clipped += (vc - r) ** 2 > (a - r) ** 2
    as_t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, n = clipped_value_loss(as_t(v), as_t(old), as_t(ret), torch.tensor(mask), clip)
    assert loss.item() == pytest.approx(want, abs=1e-12) and n == clipped > 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("critic_model")
    tiny_llama(0).save_pretrained(path)
    return path


def test_value_head_reads_the_state_before_each_response_token_and_learns(model_dir):
    critic = CriticEngine(model_dir, lr=3e-2, value_clip=10.0)
    samples = [_sample(f"s{i}", float(i % 2), 2 + i, seed=i) for i in range(4)]
    assert all(v == 0.0 for row in critic.values(samples) for v in row)  # zero-initialised head
    torch.nn.init.normal_(critic.model.head.weight, std=0.1)
    s = samples[2]
    with torch.no_grad():
        hidden = critic.model.trunk(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).last_hidden_state[0]
        want = critic.model.head(hidden).squeeze(-1)[2 : 2 + len(s.response_ids)].tolist()
    assert critic.values(samples)[2] == pytest.approx(want, abs=1e-5)
    returns = [[s.reward] * len(s.response_ids) for s in samples]
    losses = []
    for _ in range(15):
        losses.append(critic.train_step(samples, returns, critic.values(samples))["value_loss"])
    assert losses[-1] < 0.3 * losses[0]


def test_ppo_critic_step_updates_actor_and_critic(model_dir):
    samples = [_sample(f"s{i}", float(i % 3 == 0), 3 + i % 4, seed=i) for i in range(8)]
    actor = HFTrainEngine(tiny_llama(0), lr=1e-2)
    critic = CriticEngine(model_dir, lr=1e-2)
    before = {k: v.clone() for k, v in actor.export_weights().items()}
    algo = GRPOAlgorithm(estimator="gae")
    metrics = train_global_batch(actor, samples, algo, 64, UpdateSchedule(2, 1, True), 1.0, critic=critic)
    assert metrics["optimizer_steps"] == 2 and metrics["value_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert metrics["value_mean"] == 0.0 and metrics["return_mean"] > 0 and metrics["value_loss"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.export_weights().items())
    assert any(v != 0.0 for row in critic.values(samples) for v in row)  # the critic moved towards the returns


def test_values_do_not_depend_on_which_groups_share_the_call(model_dir):
    critic = CriticEngine(model_dir, lr=1e-2, token_budget=40)
    torch.nn.init.normal_(critic.model.head.weight, std=0.1)
    groups = [[_sample(f"{g}-{k}", 1.0, 2 + (g * 3 + k * 5) % 7, seed=g * 10 + k) for k in range(3)] for g in range(3)]
    groups = [[dataclasses.replace(s, group_id=g) for s in group] for g, group in enumerate(groups)]
    together = critic.values([s for group in groups for s in group])
    apart = [row for group in groups for row in critic.values(group)]
    assert together == apart  # bit for bit: the critic-values task sees groups as they arrive


def _versioned(group_id: int, version: int, n_samples: int = 2) -> list[Sample]:
    out = []
    for k in range(n_samples):
        s = _sample(f"{group_id}-{k}", float(k), 3 + k + group_id, seed=10 * group_id + k)
        out.append(dataclasses.replace(s, group_id=group_id, token_versions=(version,) * len(s.response_ids)))
    return out


def test_critic_values_task_values_each_row_with_a_critic_no_older_than_its_version(model_dir):
    section = TrainerConfig(algorithm="ppo", critic_lr=1e-2, micro_batch_tokens=64)
    spec = critic_of(section)
    assert spec == CriticSpec(lr=1e-2, token_budget=64)
    published = spec.engine(model_dir)  # the trainer's critic after one update
    torch.nn.init.normal_(published.model.head.weight, std=0.1)
    sync = InProcessWeightSync()
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, (*SAMPLE_COLUMNS, VALUES_COLUMN))
    node = _values_node()
    queue.register_task(node.id, node.reads)
    worker = NodeTaskWorker(node, queue, model_dir=model_dir, trainer=section, critic_sync=sync, batch_rows=8)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    try:
        old = _versioned(0, version=0)
        queue.put(*samples_to_rows(old, 2))  # version 0: the critic every build starts from
        batch = queue.get(TRAIN_TASK, (*SAMPLE_COLUMNS, VALUES_COLUMN), 2, timeout=30)
        assert batch.columns[VALUES_COLUMN] == [[0.0] * len(s.response_ids) for s in old]  # zero head
        new = _versioned(1, version=1)
        queue.put(*samples_to_rows(new, 2))
        assert len(queue.get(TRAIN_TASK, (*SAMPLE_COLUMNS, VALUES_COLUMN), 2, timeout=0.3)) == 0  # waits for v1
        sync.publish(published.export_weights(), 1)
        batch = queue.get(TRAIN_TASK, (*SAMPLE_COLUMNS, VALUES_COLUMN), 2, timeout=30)
        order = sorted(range(len(batch)), key=lambda k: batch.indices[k])
        assert [batch.columns[VALUES_COLUMN][k] for k in order] == published.values(new)
        critic = worker.context.models.critic
        assert worker.context.version == 1 and all(not p.requires_grad for p in critic.model.parameters())
    finally:
        queue.close()
        thread.join(timeout=30)
    assert worker.rows_done == 4


def _values_node():
    return next(n for n in load_dag("ppo").nodes if n.function == "critic_values")


def test_critic_values_task_fails_loudly_when_the_critic_never_comes(model_dir):
    worker = NodeTaskWorker(
        _values_node(), LocalQueue(), model_dir=model_dir, trainer=TrainerConfig(algorithm="ppo", critic_lr=1e-2),
        critic_sync=InProcessWeightSync(), wait_s=0.05,
    )  # fmt: skip
    worker.load_newest_critic(0)  # its own build is version 0
    with pytest.raises(TimeoutError, match="critic version 3 was not published"):
        worker.load_newest_critic(3)


def test_trainer_worker_trains_actor_and_critic_from_the_values_column_and_checkpoints_both(model_dir, tmp_path):
    groups = [_versioned(g, version=0, n_samples=3) for g in range(3)]
    flat = [s for group in groups for s in group]
    values = [[0.1 * ((i + t) % 5) for t in range(len(s.response_ids))] for i, s in enumerate(flat)]
    columns = (*SAMPLE_COLUMNS, VALUES_COLUMN)
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, columns)
    for group in groups:
        queue.put(*samples_to_rows(group, 3))
    queue.put(list(range(9)), {VALUES_COLUMN: values})  # what the critic-values task would write
    section = TrainerConfig(
        algorithm="ppo", lr=1e-2, critic_lr=1e-2, micro_batch_tokens=64, ppo_mini_batches=2, prox_logprobs="recompute"
    )
    algo, schedule, spec = algorithm_of(section), schedule_of(section), critic_of(section)
    assert spec is not None and schedule == UpdateSchedule(2, 1, True)

    def worker(path) -> TrainerWorker:
        return TrainerWorker(path, queue, InProcessWeightSync(), trainer=section, temperature=1.0, group_size=3,
                             critic_sync=InProcessWeightSync())  # fmt: skip

    trainer = worker(model_dir)
    trainer.begin_step()
    trainer.add_groups([0, 1])
    trainer.add_groups([2])
    metrics = trainer.finish_step()

    actor, critic = HFTrainEngine(tiny_llama(0), lr=1e-2), spec.engine(model_dir)
    want = train_global_batch(actor, flat, algo, 64, schedule, 1.0, critic=critic, values=values)
    assert metrics["loss"] == want["loss"] and metrics["value_loss"] == want["value_loss"] > 0
    assert metrics["value_mean"] == want["value_mean"] != 0.0  # the column's values, not a fresh critic's
    published = trainer.critic_sync.fetch(1)  # type: ignore[union-attr]
    assert all(torch.equal(published[k], v) for k, v in critic.export_weights().items())

    trainer.save_state(str(tmp_path / "ckpt"))
    resumed = worker(model_dir)
    assert resumed.load_state(str(tmp_path / "ckpt")) == 1
    assert all(torch.equal(published[k], v) for k, v in resumed.critic.export_weights().items())  # type: ignore[union-attr]
    assert resumed.critic_sync.latest_version() == 1  # type: ignore[union-attr]  # republished for the values task
