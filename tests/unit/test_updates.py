"""PPO mini-batches and epochs inside one step, with the proximal policy fixed at the step's start.

Decoupled PPO (prox recomputed when the batch arrives) equals standard PPO when the data is
fresh (prox = behav), and differs from it on stale data once there are two or more updates,
because from the second update on the current policy has moved away from the proximal one.
"""

from __future__ import annotations

import random

import pytest
import torch

from sluice.api import Sample
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.updates import (
    UpdateSchedule,
    merge_update_metrics,
    mini_batch_plan,
    mini_batch_ranges,
    proximal_logprobs,
    run_updates,
)
from tiny import VOCAB, tiny_llama

torch.set_num_threads(1)


def _samples(n: int = 12, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5)))
        k = rng.randint(2, 8)
        out.append(Sample(f"s{i}", i // 4, prompt, tuple(rng.randrange(1, VOCAB) for _ in range(k)),
                          (0.0,) * k, (0,) * k, (1,) * k, float(rng.random() < 0.5)))  # fmt: skip
    return out


def _with_behav(samples: list[Sample], behav: list[list[float]]) -> list[Sample]:
    return [Sample(s.uid, s.group_id, s.prompt_ids, s.response_ids, tuple(b), s.token_versions, s.loss_mask,
                   s.reward) for s, b in zip(samples, behav, strict=True)]  # fmt: skip


def _fresh_and_stale() -> tuple[list[Sample], list[Sample]]:
    """The same responses with behaviour log-probs of the step-start policy (fresh) and of an
    older, perturbed policy (stale)."""
    samples = _samples()
    fresh = HFTrainEngine(tiny_llama(0), lr=0.0).logprobs(samples, 1.0)
    old = tiny_llama(0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in old.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    stale = HFTrainEngine(old, lr=0.0).logprobs(samples, 1.0)
    return _with_behav(samples, fresh), _with_behav(samples, stale)


def _train(samples: list[Sample], schedule: UpdateSchedule) -> dict[str, torch.Tensor]:
    engine = HFTrainEngine(tiny_llama(0), lr=3e-2)
    train_global_batch(engine, samples, GRPOAlgorithm(), 64, schedule, 1.0)
    return engine.export_weights()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_mini_batch_ranges_cover_in_order() -> None:
    assert mini_batch_ranges(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert mini_batch_ranges(2, 4) == [range(0, 1), range(1, 2)]
    assert mini_batch_ranges(0, 2) == []


def test_merge_update_metrics_averages_loss_and_sums_counts() -> None:
    merged = merge_update_metrics(
        [{"loss": 1.0, "grad_norm": 2.0, "tokens": 3.0}, {"loss": 3.0, "grad_norm": 4.0, "tokens": 5.0}]
    )
    assert merged == {"loss": 2.0, "grad_norm": 3.0, "tokens": 8.0, "optimizer_steps": 2.0}
    single = {"loss": 0.1 + 0.2, "tokens": 3.0}
    assert merge_update_metrics([single]) == {**single, "optimizer_steps": 1.0}


def test_decoupled_ppo_equals_ppo_on_fresh_data() -> None:
    fresh, _ = _fresh_and_stale()
    for mini_batches, epochs in ((2, 1), (3, 2)):
        decoupled = _train(fresh, UpdateSchedule(mini_batches, epochs, recompute_prox=True))
        standard = _train(fresh, UpdateSchedule(mini_batches, epochs, recompute_prox=False))
        assert _same(decoupled, standard)


def test_decoupled_ppo_differs_on_stale_data_with_two_mini_batches() -> None:
    _, stale = _fresh_and_stale()
    decoupled = _train(stale, UpdateSchedule(2, 1, recompute_prox=True))
    standard = _train(stale, UpdateSchedule(2, 1, recompute_prox=False))
    assert not _same(decoupled, standard)


def test_prox_is_the_step_start_policy_so_later_updates_move_away_from_it() -> None:
    _, stale = _fresh_and_stale()
    engine = HFTrainEngine(tiny_llama(0), lr=3e-2)
    schedule = UpdateSchedule(2, 2, recompute_prox=True)
    algorithm = GRPOAlgorithm()
    prox = proximal_logprobs(engine, stale, schedule, 1.0)
    assert prox != [list(s.behav_logprobs) for s in stale]
    updates = run_updates(engine, stale, algorithm.advantages(stale), prox, algorithm, 64, schedule)
    assert len(updates) == 4
    assert updates[0]["kl_prox_sum"] == pytest.approx(0.0, abs=1e-9)  # first update: current == prox
    assert updates[0]["clipped_tokens"] == 0
    assert all(u["kl_prox_sum"] > 1e-6 for u in updates[1:])  # then the policy has moved
    # the prox stayed fixed: the third update sees the first mini-batch again, now off-policy
    assert updates[2]["tokens"] == updates[0]["tokens"]


def test_default_schedule_is_one_streaming_update() -> None:
    schedule = UpdateSchedule()
    assert schedule.streams and schedule.updates == 1 and not schedule.recompute_prox
    assert not UpdateSchedule(1, 2).streams
    with pytest.raises(ValueError, match="mini_batches"):
        UpdateSchedule(0, 1)


def test_mini_batch_plan_gives_every_rank_the_whole_mini_batch_normaliser() -> None:
    samples = _samples(10)
    algorithm = GRPOAlgorithm()
    whole = mini_batch_plan(samples, algorithm, 3)
    assert [p.mine for p in whole] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    rank0 = mini_batch_plan(samples, algorithm, 3, [0, 1, 5, 9])
    assert [p.mine for p in rank0] == [(0, 1), (2,), (3,)]  # indices into the rank's own samples
    assert [p.normaliser for p in rank0] == [p.normaliser for p in whole]
    assert mini_batch_plan(samples, algorithm, 3, [])[0].mine == ()  # a rank without samples still updates
