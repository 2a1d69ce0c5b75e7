"""The trainer's step and update functions against ``FakeTrainEngine``: which engine calls they make,
in which order, with which gradient scale.

The fake's weight moves by ``Σ advantage · loss_mask / normaliser`` per update, so a skipped or
repeated micro-batch, a wrong cut or a wrong scale changes ``w`` as well as the call list.
"""

from __future__ import annotations

import pytest

from fakes import FakeAlgorithm, FakeTrainEngine
from sluice.api import Sample, TrainEngine
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.step import InOrderPacker, plan_step, run_step, step_normaliser
from sluice.trainer.updates import ONE_UPDATE, UpdateSchedule, proximal_logprobs, run_updates

BUDGET = 10
"""Micro-batch token budget: the samples below cut as (s0, s1) | (s2) | (s3, s4)."""


def _sample(i: int, prompt: int, mask: tuple[int, ...], reward: float) -> Sample:
    n = len(mask)
    return Sample(f"s{i}", i // 2, tuple(range(1, prompt + 1)), tuple(range(5, 5 + n)), (-1.0,) * n, (0,) * n,
                  mask, reward)  # fmt: skip


def _samples() -> list[Sample]:
    """Tokens 5, 4, 9, 2, 6; loss tokens 3, 1, 6, 1, 3 (14); Σ reward · loss tokens = 15.25."""
    return [
        _sample(0, 2, (1, 1, 1), 1.0),
        _sample(1, 2, (1, 0), 0.5),
        _sample(2, 3, (1,) * 6, 2.0),
        _sample(3, 1, (1,), -1.0),
        _sample(4, 2, (0, 1, 1, 1), 0.25),
    ]


CUTS = [("s0", "s1"), ("s2",), ("s3", "s4")]


def test_fake_is_a_train_engine(tmp_path) -> None:
    engine = FakeTrainEngine()
    assert isinstance(engine, TrainEngine)
    engine.w = 0.5
    engine.save(str(tmp_path))
    other = FakeTrainEngine()
    other.load(str(tmp_path))
    assert other.export_weights()["w"].item() == 0.5


def test_whole_batch_step_accumulates_every_micro_batch_in_order_and_scales_once() -> None:
    engine, samples = FakeTrainEngine(), _samples()
    metrics = train_global_batch(engine, samples, FakeAlgorithm(), BUDGET, ONE_UPDATE, temperature=1.0)
    assert engine.calls == [
        ("begin_step",),
        *[("accumulate", cut) for cut in CUTS],
        ("finish_step", pytest.approx(1 / 14)),
    ]
    assert engine.w == pytest.approx(15.25 / 14)
    assert metrics["optimizer_steps"] == 1.0 and metrics["grad_norm"] == pytest.approx(15.25 / 14)


def test_streamed_packing_makes_the_whole_batch_calls() -> None:
    """The streaming worker's path: samples arrive in two parts, micro-batches run as they close."""
    samples, algorithm = _samples(), FakeAlgorithm()
    whole = FakeTrainEngine()
    run_step(whole, plan_step(samples, algorithm, BUDGET), algorithm, step_normaliser(samples, algorithm))
    streamed = FakeTrainEngine()
    packer = InOrderPacker(BUDGET)
    streamed.begin_step()
    for part in (samples[:2], samples[2:]):
        for mb in packer.add(part, algorithm.advantages(part)):
            streamed.accumulate(mb, algorithm)
    for mb in packer.flush():
        streamed.accumulate(mb, algorithm)
    streamed.finish_step(grad_scale=1.0 / step_normaliser(packer.samples, algorithm))
    assert streamed.calls == whole.calls
    assert streamed.w == whole.w == pytest.approx(15.25 / 14)


def test_mini_batches_and_epochs_are_separate_updates_with_their_own_normalisers() -> None:
    engine, samples, algorithm = FakeTrainEngine(), _samples(), FakeAlgorithm()
    schedule = UpdateSchedule(mini_batches=2, epochs=2)
    prox = proximal_logprobs(engine, samples, schedule, 1.0)
    updates = run_updates(engine, samples, algorithm.advantages(samples), prox, algorithm, BUDGET, schedule)
    first = [("begin_step",), ("accumulate", ("s0", "s1")), ("accumulate", ("s2",)), ("finish_step", 1 / 10)]
    second = [("begin_step",), ("accumulate", ("s3", "s4")), ("finish_step", 1 / 4)]
    assert engine.calls == (first + second) * 2  # mini-batches s0-s2 (10 loss tokens), s3-s4 (4)
    assert len(updates) == 4
    assert engine.w == pytest.approx(2 * (15.5 / 10 - 0.25 / 4))


def test_recomputed_proximal_logprobs_come_from_the_step_start_weights() -> None:
    engine, samples = FakeTrainEngine(), _samples()
    engine.w = 0.5
    schedule = UpdateSchedule(recompute_prox=True)
    train_global_batch(engine, samples, FakeAlgorithm(), BUDGET, schedule, temperature=1.0)
    assert engine.calls[0] == ("logprobs", tuple(s.uid for s in samples))
    assert engine.calls[1:] == [
        ("begin_step",),
        *[("accumulate", cut) for cut in CUTS],
        ("finish_step", pytest.approx(1 / 14)),
    ]
    assert proximal_logprobs(FakeTrainEngine(), samples, ONE_UPDATE, 1.0) == [
        [-1.0] * len(s.response_ids) for s in samples
    ]


def test_a_held_step_packs_each_update_into_the_fewest_micro_batches() -> None:
    """Two PPO epochs hold the step (AReaL's dynamic allocation): tokens 5, 4, 9, 2, 6 under a
    budget of 15 take three passes cut in order, (s0, s1) | (s2, s3) | (s4), and two packed
    longest first, (s2, s4) | (s0, s1, s3). Which samples share a pass changes, the update not."""
    samples, algorithm = _samples(), FakeAlgorithm()
    held = UpdateSchedule(mini_batches=1, epochs=2)
    engine = FakeTrainEngine()
    train_global_batch(engine, samples, algorithm, 15, held, temperature=1.0)
    passes = [call[1] for call in engine.calls if call[0] == "accumulate"]
    assert passes == [("s2", "s4"), ("s0", "s1", "s3")] * 2
    in_order = FakeTrainEngine()
    prox = proximal_logprobs(in_order, samples, held, 1.0)
    run_updates(in_order, samples, algorithm.advantages(samples), prox, algorithm, 15, held)
    assert len([c for c in in_order.calls if c[0] == "accumulate"]) == 6
    assert engine.w == pytest.approx(in_order.w)


def test_a_streamable_step_keeps_its_arrival_cuts_when_held() -> None:
    """One update with per-group advantages could stream: ``train_global_batch`` cuts it in
    arrival order, so it equals the streamed step call for call (``test_streamed_packing...``)."""
    engine = FakeTrainEngine()
    train_global_batch(engine, _samples(), FakeAlgorithm(), 15, ONE_UPDATE, temperature=1.0)
    assert [c[1] for c in engine.calls if c[0] == "accumulate"] == [("s0", "s1"), ("s2", "s3"), ("s4",)]


def test_balanced_packing_keeps_every_sample_once_under_the_budget() -> None:
    from sluice.trainer.step import pack_balanced

    samples = [_sample(i, 1 + i % 3, (1,) * (1 + (7 * i) % 9), 1.0) for i in range(40)]
    budget = 16
    packed = pack_balanced(samples, [[0.0] * len(s.response_ids) for s in samples], [[]] * 40, budget)
    uids = [s.uid for mb in packed for s in mb.samples]
    assert sorted(uids) == sorted(s.uid for s in samples) and len(uids) == 40
    assert all(mb.num_tokens <= budget for mb in packed)
    lower_bound = -(-sum(s.num_tokens for s in samples) // budget)
    assert len(packed) <= lower_bound + 1  # first-fit decreasing: within a pass of the optimum here
    packer = InOrderPacker(budget)
    in_order = packer.add(samples, [[0.0] * len(s.response_ids) for s in samples]) + packer.flush()
    assert len(packed) < len(in_order)
