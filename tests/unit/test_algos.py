"""RLOO, REINFORCE++ (and baseline), GAE against plain-Python references (floats and loops)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from sluice.api.types import Sample
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.algos import ADVANTAGE_ESTIMATORS, WHOLE_BATCH_ESTIMATORS, gae

torch.set_num_threads(1)


def ref_rloo(groups: list[list[float]]) -> list[list[float]]:
    out = []
    for row in groups:
        n = len(row)
        out.append([0.0 if n < 2 else r - (sum(row) - r) / (n - 1) for r in row])
    return out


def ref_whiten(values: list[float], counts: list[int], eps: float) -> list[float]:
    tokens = [v for v, c in zip(values, counts, strict=True) for _ in range(c)]  # one entry per token
    if not tokens:
        return [0.0] * len(values)
    mean = statistics.fmean(tokens)
    std = statistics.pstdev(tokens)
    return [(v - mean) / (std + eps) for v in values]


def ref_gae(rewards, values, gamma, lam, mask):
    T = len(rewards)
    idx = [t for t in range(T) if mask[t]]  # loss tokens only, in order
    v_next = values[T] if len(values) == T + 1 else 0.0
    adv, ret = [0.0] * T, [0.0] * T
    running = 0.0
    for k in reversed(range(len(idx))):
        t = idx[k]
        nxt = values[idx[k + 1]] if k + 1 < len(idx) else v_next
        running = rewards[t] + gamma * nxt - values[t] + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
    return adv, ret


def _batch(seed: int):
    rng = random.Random(seed)
    sizes = [4, 1, 3, 4]  # unequal groups, including a group of one
    rewards, groups, counts = [], [], []
    for g, n in enumerate(sizes):
        for _ in range(n):
            rewards.append(float(rng.choice([0.0, 1.0, rng.uniform(-1, 2)])))
            groups.append(g)
            counts.append(rng.randint(0, 6))  # includes samples with no loss tokens
    rewards[-4:] = [0.5] * 4  # an all-equal group
    return rewards, groups, counts


def _run(name: str, rewards, groups, counts, eps=1e-6) -> list[float]:
    fn = ADVANTAGE_ESTIMATORS[name]
    out = fn(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        torch.tensor(counts, dtype=torch.float64),
        eps,
    )
    return out.tolist()


def test_rloo_matches_reference() -> None:
    rewards, groups, counts = _batch(0)
    got = _run("rloo", rewards, groups, counts)
    rows = [[r for r, g in zip(rewards, groups, strict=True) if g == k] for k in range(4)]
    want = [a for row in ref_rloo(rows) for a in row]  # samples are stored group by group
    assert got == pytest.approx(want, abs=1e-12)
    assert got[4] == 0.0 and got[-4:] == [0.0] * 4  # group of one; all-equal group


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_reference(baseline: bool) -> None:
    rewards, groups, counts = _batch(1)
    values = list(rewards)
    if baseline:
        for k in set(groups):
            members = [i for i, g in enumerate(groups) if g == k]
            mean = statistics.fmean(rewards[i] for i in members)
            for i in members:
                values[i] = rewards[i] - mean
    got = _run("reinforce_pp_baseline" if baseline else "reinforce_pp", rewards, groups, counts)
    assert got == pytest.approx(ref_whiten(values, counts, 1e-6), abs=1e-9)
    # Token-weighted: mean over loss tokens is 0, std 1.
    tokens = [a for a, c in zip(got, counts, strict=True) for _ in range(c)]
    assert statistics.fmean(tokens) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pstdev(tokens) == pytest.approx(1.0, abs=1e-5)


def test_reinforce_pp_degenerate_batches() -> None:
    assert _run("reinforce_pp", [1.0, 1.0], [0, 0], [3, 2]) == [0.0, 0.0]  # all equal
    assert _run("reinforce_pp", [1.0, 0.0], [0, 0], [0, 0]) == [0.0, 0.0]  # no loss tokens


@pytest.mark.parametrize("bootstrap", [False, True])
def test_gae_matches_reference(bootstrap: bool) -> None:
    rng = random.Random(2)
    T = 9
    rewards = [rng.uniform(-1, 1) for _ in range(T)]
    values = [rng.uniform(-1, 1) for _ in range(T + (1 if bootstrap else 0))]
    mask = [True, True, False, True, True, False, False, True, True]
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        adv, ret = gae(
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(values, dtype=torch.float64),
            gamma,
            lam,
            torch.tensor(mask),
        )
        want_adv, want_ret = ref_gae(rewards, values, gamma, lam, mask)
        assert adv.tolist() == pytest.approx(want_adv, abs=1e-12)
        assert ret.tolist() == pytest.approx(want_ret, abs=1e-12)
    # γ = λ = 1, zero values, outcome reward at the end: every token's advantage is the reward.
    adv, _ = gae(torch.tensor([0.0, 0.0, 3.0]), torch.zeros(3))
    assert adv.tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        gae(torch.zeros(3), torch.zeros(5))


def test_gae_registry_entry_explains_missing_values() -> None:
    with pytest.raises(ValueError, match="critic"):
        _run("gae", [1.0], [0], [1])
    with pytest.raises(ValueError, match="critic"):
        GRPOAlgorithm(estimator="gae").advantages([_sample("a", 0, 1.0, 2)])


def _sample(uid: str, group_id: int, reward: float, n_resp: int, masked: int = 0) -> Sample:
    return Sample(
        uid=uid,
        group_id=group_id,
        prompt_ids=(1,),
        response_ids=tuple(range(2, 2 + n_resp)),
        behav_logprobs=(-1.0,) * n_resp,
        token_versions=(0,) * n_resp,
        loss_mask=(0,) * masked + (1,) * (n_resp - masked),
        reward=reward,
    )


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_algorithm_broadcasts_flat_estimators(estimator: str) -> None:
    rng = random.Random(3)
    samples = [
        _sample(f"s{i}", gid, rng.uniform(0, 1), rng.randint(2, 5), rng.randint(0, 1))
        for i, gid in enumerate([7, 3, 7, 3, 7, 9])
    ]
    algo = GRPOAlgorithm(estimator=estimator)
    assert algo.whole_batch_advantages == (estimator in WHOLE_BATCH_ESTIMATORS)
    adv = algo.advantages(samples)
    dense = {7: 0, 3: 1, 9: 2}
    want = _run(
        estimator,
        [s.reward for s in samples],
        [dense[s.group_id] for s in samples],
        [sum(s.loss_mask) for s in samples],
    )
    for a, w, s in zip(adv, want, samples, strict=True):
        assert a == [w] * len(s.response_ids)
    assert all(math.isfinite(x) for row in adv for x in row)
    assert algo.advantages([]) == []


def test_the_group_relative_set_is_the_estimators_that_learn_nothing_from_one_sample_groups():
    """``config.trainer.GROUP_RELATIVE`` (``rollout.group_size: 1`` refused) is exactly the estimators
    whose advantages are all zero or not finite when every group holds one sample."""
    from sluice.config.trainer import GROUP_RELATIVE

    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.25])
    groups, tokens = torch.arange(6), torch.tensor([3, 5, 2, 4, 6, 1])
    blind = set()
    for name, estimate in ADVANTAGE_ESTIMATORS.items():
        if name == "gae":  # needs a critic's values: PPO (group size 1 is fine there)
            continue
        adv = estimate(rewards, groups, tokens, 1e-6)
        if not torch.isfinite(adv).all() or bool((adv == 0).all()):
            blind.add(name)
    assert blind == GROUP_RELATIVE
