"""LR schedules (``trainer.lr_schedule``, ``lr_warmup_steps``): the engine's learning rate per
optimizer update follows warmup then constant / linear / cosine decay, a checkpoint continues it
where it stopped, and the config refuses a warmup longer than the run."""

from __future__ import annotations

import math

import pytest
import torch
from test_hf_train import make_samples, step_batches

from sluice.config import ConfigError, TrainerConfig, load_config
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.sections import engine_options, lr_schedule_of
from sluice.trainer.step import run_step
from tiny import tiny_llama

torch.set_num_threads(1)


def _engine(section: TrainerConfig, steps: int) -> HFTrainEngine:
    return HFTrainEngine(tiny_llama(0), **engine_options(section, 1.0, steps))


def _lrs(engine: HFTrainEngine, updates: int) -> list[float]:
    samples, out = make_samples(6), []
    for _ in range(updates):
        out.append(run_step(engine, step_batches(engine, samples, [6]), GRPOAlgorithm(), 1.0)["lr"])
    return out


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),  # the warmup starts above 0, full at its last update
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
        ("cosine", [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
    ],
)
def test_each_schedule_warms_up_then_follows_its_shape(name, want):
    section = TrainerConfig(lr=1e-2, lr_schedule=name, lr_warmup_steps=2)
    got = _lrs(_engine(section, steps=6), 6)
    assert got == pytest.approx([1e-2 * w for w in want])


def test_the_schedule_counts_optimizer_updates_and_constant_without_warmup_has_none():
    assert lr_schedule_of(TrainerConfig(), 10) is None  # today's constant lr: no scheduler at all
    mini = lr_schedule_of(TrainerConfig(lr_schedule="cosine", lr_warmup_steps=1, ppo_mini_batches=2, ppo_epochs=2), 5)
    assert mini is not None and (mini.warmup_updates, mini.total_updates) == (4, 20)


def test_a_checkpoint_continues_the_schedule_where_it_stopped(tmp_path):
    section = TrainerConfig(lr=1e-2, lr_schedule="linear", lr_warmup_steps=1)
    whole = _engine(section, steps=5)
    want = _lrs(whole, 5)
    first = _engine(section, steps=5)
    _lrs(first, 2)
    first.save(str(tmp_path))
    resumed = _engine(section, steps=5)
    resumed.load(str(tmp_path))
    assert _lrs(resumed, 3) == pytest.approx(want[2:])  # a fresh scheduler would restart the warmup


def test_a_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.lr_warmup_steps \(30\) exceeds run.steps \(20\)"):
        load_config(None, ["trainer.lr_warmup_steps=30", "run.steps=20"])


def test_the_learning_rate_is_logged_without_a_schedule_too():
    assert _lrs(_engine(TrainerConfig(lr=1e-2), steps=2), 2) == pytest.approx([1e-2, 1e-2])
