"""A reward model's scores combined with the rule reward (``reward.combine``), the running mean /
std normalisation, and a failed batch marking its group's samples as reward failures."""

import asyncio
import math

import pytest

from sluice.api import Sample
from sluice.rewards.combine import ModelReward
from sluice.rewards.reward_model import RewardModelPool, RewardModelSpec
from sluice.rollout.filters import reward_failure
from tiny import save_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tiny_task_model, tmp_path_factory):
    return save_tiny_reward_model(tiny_task_model, tmp_path_factory.mktemp("rm") / "rm")


def group(gid, responses, rules):
    return [
        Sample(f"{gid}-{k}", gid, (1,), tuple(ids), (0.0,) * len(ids), (0,) * len(ids), (1,) * len(ids), rule)
        for k, (ids, rule) in enumerate(zip(responses, rules, strict=True))
    ]


def decode(ids):
    return "".join(str(i % 10) for i in ids)


def test_scores_combine_and_normalise_by_running_moments(reward_model):
    pool = RewardModelPool(RewardModelSpec(str(reward_model), token_budget=64))
    combined = ModelReward(pool, "sum", model_weight=0.5, rule_weight=2.0, normalize=True)
    groups = [group(0, [(5, 6), (7,), (8, 9, 10)], [1.0, 0.0, 0.0]), group(1, [(4, 4, 4, 4), (6,)], [0.0, 1.0])]
    seen: list[float] = []
    for samples in groups:
        out = asyncio.run(combined.apply("12>", samples, decode))
        raw = asyncio.run(pool.score([("12>", decode(s.response_ids)) for s in samples]))
        seen += raw
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((x - mean) ** 2 for x in seen) / len(seen))
        for s, o, r in zip(samples, out, raw, strict=True):
            assert o.meta["rm_score"] == pytest.approx(r, abs=1e-6) and o.meta["rule_reward"] == s.reward
            assert o.reward == pytest.approx(2.0 * s.reward + 0.5 * (r - mean) / std, abs=1e-5)
    stats = combined.stats()
    assert stats["rm_normalised"] == 5.0 and stats["rm_running_mean"] == pytest.approx(mean)
    alone = ModelReward(pool, "model", model_weight=1.0)
    out = asyncio.run(alone.apply("12>", groups[0], decode))
    assert [o.reward for o in out] == [o.meta["rm_score"] for o in out] and "rule_reward" not in out[0].meta


def test_a_failed_batch_fails_its_groups(reward_model):
    pool = RewardModelPool(RewardModelSpec(str(reward_model), token_budget=64))

    def broken(rows):
        raise RuntimeError("out of memory")

    pool.workers[0].score = broken
    out = asyncio.run(ModelReward(pool).apply("12>", group(0, [(5,), (6,)], [1.0, 0.0]), decode))
    assert reward_failure(out) == "reward_error:reward_model"
    assert out[0].meta["reward_failure_cause"] == ("reward 'reward_model'", "RuntimeError: out of memory")
    assert pool.stats()["reward_error:reward_model"] == 1.0
