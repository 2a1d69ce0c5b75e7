"""Token-budgeted micro-batching (pure balancing), MicroBatch construction and padding."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.api.types import Sample
from sluice.engines.padding import pad_batch
from sluice.trainer.microbatch import balance_by_tokens, make_micro_batches

torch.set_num_threads(1)


def check_partition(counts: list[int], budget: int, bins: list[list[int]]) -> None:
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(counts)))
    for b in bins:
        assert b == sorted(b)
        if len(b) > 1:
            assert sum(counts[i] for i in b) <= budget
        elif counts[b[0]] > budget:
            assert len(b) == 1
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)


@pytest.mark.parametrize("seed", range(20))
def test_budget_respected_each_index_once_deterministic(seed: int) -> None:
    rng = random.Random(seed)
    counts = [rng.randint(1, 120) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(60, 300)
    bins = balance_by_tokens(counts, budget)
    check_partition(counts, budget, bins)
    assert balance_by_tokens(list(counts), budget) == bins


def test_oversize_sample_alone() -> None:
    counts = [10, 500, 20, 30, 400]
    bins = balance_by_tokens(counts, 100)
    check_partition(counts, 100, bins)
    assert [1] in bins and [4] in bins
    assert sorted(len(b) for b in bins) == [1, 1, 3]


def test_balanced_loads() -> None:
    counts = [50, 50, 40, 40, 30, 30, 20, 20, 10, 10]  # 300 tokens, budget 100 → 3 bins of 100
    bins = balance_by_tokens(counts, 110)
    loads = [sum(counts[i] for i in b) for b in bins]
    assert len(bins) == 3 and max(loads) - min(loads) <= 20


def test_edge_cases() -> None:
    assert balance_by_tokens([], 10) == []
    assert balance_by_tokens([0, 0, 3], 3) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        balance_by_tokens([1], 0)


def sample(uid: int, n_prompt: int, n_resp: int, mask_first: bool = False) -> Sample:
    return Sample(
        uid=f"s{uid}",
        group_id=uid // 2,
        prompt_ids=tuple(range(1, 1 + n_prompt)),
        response_ids=tuple(range(10 + uid, 10 + uid + n_resp)),
        behav_logprobs=tuple(-0.1 * (j + 1) for j in range(n_resp)),
        token_versions=(0,) * n_resp,
        loss_mask=tuple(0 if (mask_first and j == 0) else 1 for j in range(n_resp)),
        reward=float(uid),
    )


def test_make_micro_batches_shares_step_normaliser() -> None:
    samples = [sample(i, 3 + i % 3, 2 + i, mask_first=i % 2 == 0) for i in range(7)]
    adv = [[float(i)] * len(s.response_ids) for i, s in enumerate(samples)]
    prox = [list(s.behav_logprobs) for s in samples]
    mbs = make_micro_batches(samples, adv, prox, token_budget=20)
    assert len(mbs) > 1 and all(mb.num_tokens <= 20 for mb in mbs)
    loss_tokens = sum(sum(s.loss_mask) for s in samples)
    assert {mb.normaliser for mb in mbs} == {float(loss_tokens)}
    by_uid = {s.uid: (a, p) for mb in mbs for s, a, p in zip(mb.samples, mb.advantages, mb.prox_logprobs, strict=True)}
    assert sorted(by_uid) == sorted(s.uid for s in samples)
    for i, s in enumerate(samples):
        assert by_uid[s.uid] == (tuple(adv[i]), tuple(prox[i]))
    assert make_micro_batches(samples, adv, prox, 20, normaliser=5.0)[0].normaliser == 5.0


def test_pad_batch_indexes_response_tokens() -> None:
    samples = [sample(0, 3, 4), sample(1, 1, 2), sample(2, 5, 0), sample(3, 2, 6)]
    b = pad_batch(samples, pad_id=0)
    assert b["input_ids"].shape == (4, 8) and b["attention_mask"].sum().item() == 7 + 3 + 5 + 8
    assert b["response_lengths"].tolist() == [4, 2, 0, 6]
    assert b["targets"].tolist() == [t for s in samples for t in s.response_ids]
    assert b["input_ids"][b["logit_rows"], b["logit_cols"] + 1].tolist() == b["targets"].tolist()
    assert b["response_mask"].sum().item() == 12
    assert b["input_ids"][b["response_mask"]].tolist() == b["targets"].tolist()
    assert b["behav_logprobs"].shape == b["loss_mask"].shape == (12,)
    assert b["input_ids"][1, 3:].tolist() == [0] * 5 and b["attention_mask"][1, 3:].sum().item() == 0
    with pytest.raises(ValueError):
        pad_batch([sample(0, 0, 2)])
