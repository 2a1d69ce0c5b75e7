"""PPO with a critic: per-token rewards, GAE targets and whitening, the clipped value loss and the
value head, against plain-Python references; one whole step on tiny models."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.api import Sample
from sluice.engines.critic import CriticEngine, clipped_value_loss
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.ppo import gae_targets, ppo_critic_step, token_rewards, whiten
from sluice.trainer.updates import UpdateSchedule
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
    metrics = ppo_critic_step(actor, critic, samples, algo, 64, UpdateSchedule(2, 1, True), 1.0)
    assert metrics["optimizer_steps"] == 2 and metrics["value_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert metrics["value_mean"] == 0.0 and metrics["return_mean"] > 0 and metrics["value_loss"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.export_weights().items())
    assert any(v != 0.0 for row in critic.values(samples) for v in row)  # the critic moved towards the returns
