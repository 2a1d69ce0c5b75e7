"""GRPO / Dr.GRPO advantages against a plain-Python reference, and GRPOAlgorithm grouping."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from sluice.api.protocols import Algorithm
from sluice.api.types import Sample
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.algos import ADVANTAGE_ESTIMATORS, grpo_advantages

torch.set_num_threads(1)


def reference_advantages(rows: list[list[float]], eps: float, scale_by_std: bool) -> list[list[float]]:
    out = []
    for row in rows:
        mean = statistics.fmean(row)
        std = statistics.pstdev(row)
        out.append([(r - mean) / (std + eps) if scale_by_std else r - mean for r in row])
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_reference(scale_by_std: bool) -> None:
    rng = random.Random(0)
    rows = [[rng.uniform(-2, 3) for _ in range(6)] for _ in range(5)]
    rows.append([1.0] * 6)  # all-equal group
    rows.append([rng.choice([0.0, 1.0]) for _ in range(6)])
    got = grpo_advantages(torch.tensor(rows, dtype=torch.float64), eps=1e-6, scale_by_std=scale_by_std)
    want = reference_advantages(rows, 1e-6, scale_by_std)
    for got_row, want_row in zip(got.tolist(), want, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-9)
    assert got[5].abs().max().item() == 0.0


def test_group_of_one_is_zero_and_bad_shape_rejected() -> None:
    assert grpo_advantages(torch.tensor([[3.0]])).tolist() == [[0.0]]
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]))


def test_registry_has_both_estimators() -> None:
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups, tokens = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64)
    assert torch.allclose(ADVANTAGE_ESTIMATORS["dr_grpo"](rewards, groups, tokens, 1e-6), rewards - 0.5)
    grpo = ADVANTAGE_ESTIMATORS["grpo"](rewards, groups, tokens, 1e-6)
    assert torch.allclose(grpo, (rewards - 0.5) / (0.5 + 1e-6))


def _sample(uid: str, group_id: int, reward: float, n_resp: int) -> Sample:
    return Sample(
        uid=uid,
        group_id=group_id,
        prompt_ids=(1, 2),
        response_ids=tuple(range(3, 3 + n_resp)),
        behav_logprobs=(-1.0,) * n_resp,
        token_versions=(0,) * n_resp,
        loss_mask=(1,) * n_resp,
        reward=reward,
    )


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_algorithm_groups_interleaved_unequal_groups(estimator: str) -> None:
    rng = random.Random(1)
    samples = [_sample(f"s{i}", gid, rng.uniform(0, 1), rng.randint(1, 5)) for i, gid in enumerate([7, 3, 7, 3, 7, 9])]
    algo = GRPOAlgorithm(estimator=estimator)
    assert isinstance(algo, Algorithm)
    adv = algo.advantages(samples)
    scale = estimator == "grpo"
    for gid in (7, 3, 9):
        members = [i for i, s in enumerate(samples) if s.group_id == gid]
        want = reference_advantages([[samples[i].reward for i in members]], 1e-6, scale)[0]
        for i, w in zip(members, want, strict=True):
            assert len(adv[i]) == len(samples[i].response_ids)
            assert adv[i] == pytest.approx([w] * len(adv[i]), abs=1e-9)


def test_algorithm_rejects_unknown_estimator() -> None:
    with pytest.raises(ValueError):
        GRPOAlgorithm(estimator="nope")
