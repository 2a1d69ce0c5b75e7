"""The streaming trainer worker equals a whole-batch step over the same samples, bit for bit,
both for group-local advantages (streamed per group) and for REINFORCE++ (held until the step
ends, because its whitening spans the whole batch)."""

import random

import pytest
import torch

from sluice.api import Sample
from sluice.config import TrainerConfig
from sluice.engines.hf_train import HFTrainEngine
from sluice.queue import LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS, samples_to_rows
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.updates import ONE_UPDATE, UpdateSchedule
from sluice.trainer.worker import TRAIN_TASK, TrainerWorker
from sluice.weights import InProcessWeightSync
from tiny import VOCAB, tiny_llama

GROUP = 4


def _groups(num_groups: int, seed: int = 0) -> list[list[Sample]]:
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6)))
        group = []
        for k in range(GROUP):
            n = rng.randint(1, 9)
            group.append(
                Sample(f"{g}-{k}", g, prompt, tuple(rng.randrange(1, VOCAB) for _ in range(n)),
                       tuple(-rng.random() for _ in range(n)), (0,) * n, (1,) * n, float(rng.random() < 0.5))
            )  # fmt: skip
        groups.append(group)
    return groups


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker_model")
    tiny_llama(0).save_pretrained(path)
    return path


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp"])
def test_streamed_groups_equal_the_whole_batch_step(model_dir, estimator):
    groups = _groups(5)
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, SAMPLE_COLUMNS)
    for group in groups:
        queue.put(*samples_to_rows(group, GROUP))
    algorithm = GRPOAlgorithm(estimator=estimator)
    sync = InProcessWeightSync()
    trainer = TrainerConfig(algorithm=estimator, lr=1e-2, micro_batch_tokens=40)
    worker = TrainerWorker(model_dir, queue, sync, trainer=trainer, temperature=1.0, group_size=GROUP)
    worker.begin_step()
    for chunk in ([0, 1], [2], [3, 4]):  # groups arrive in three hand-offs
        worker.add_groups(chunk)
    metrics = worker.finish_step()

    reference = HFTrainEngine(tiny_llama(0), lr=1e-2)
    samples = [s for g in groups for s in g]
    # grpo streams, cut in arrival order; reinforce_pp's whole-batch advantages hold the step,
    # packed into the fewest micro-batches: the whole-batch step is the same function either way
    expected = train_global_batch(reference, samples, algorithm, 40, ONE_UPDATE, 1.0)
    assert metrics["loss"] == expected["loss"] and metrics["micro_batches"] == expected["micro_batches"] > 1
    published = sync.fetch(1)
    for name, value in reference.export_weights().items():
        assert torch.equal(published[name], value), name
    assert queue.get(TRAIN_TASK, SAMPLE_COLUMNS, 1, timeout=0).indices == ()  # every row consumed once


def test_mini_batch_schedule_waits_for_the_step_then_equals_the_whole_batch_updates(model_dir):
    groups = _groups(4, seed=3)
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, SAMPLE_COLUMNS)
    for group in groups:
        queue.put(*samples_to_rows(group, GROUP))
    algorithm, sync = GRPOAlgorithm(), InProcessWeightSync()
    schedule = UpdateSchedule(mini_batches=2, epochs=2, recompute_prox=True)
    trainer = TrainerConfig(lr=1e-2, micro_batch_tokens=40, ppo_mini_batches=2, ppo_epochs=2, prox_logprobs="recompute")
    worker = TrainerWorker(model_dir, queue, sync, trainer=trainer, temperature=1.0, group_size=GROUP)
    worker.begin_step()
    worker.add_groups([0, 1])
    assert worker.engine.model.model.embed_tokens.weight.grad is None  # held: no update before the whole step
    worker.add_groups([2, 3])
    metrics = worker.finish_step()

    reference = HFTrainEngine(tiny_llama(0), lr=1e-2)
    samples = [s for g in groups for s in g]
    expected = train_global_batch(reference, samples, algorithm, 40, schedule, reference.temperature)
    assert metrics["optimizer_steps"] == 4 and metrics["version"] == 1 and metrics["loss"] == expected["loss"]
    published = sync.fetch(1)
    for name, value in reference.export_weights().items():
        assert torch.equal(published[name], value), name


def test_the_worker_drives_its_engine_through_the_protocol_and_publishes_each_version():
    """Against ``FakeTrainEngine``: groups handed over in three chunks are read from the queue and
    accumulated in the step's order, one ``finish_step`` scales by 1 / (the step's loss tokens),
    and the new version's weights are published; a skipped or reordered micro-batch, a wrong
    scale or a missing publish fails here."""
    from fakes import FakeAlgorithm, FakeQueueClient, FakeTrainEngine, FakeWeightSync

    groups = _groups(5, seed=3)
    queue = FakeQueueClient()
    queue.register_task(TRAIN_TASK, SAMPLE_COLUMNS)
    for group in groups:
        queue.put(*samples_to_rows(group, GROUP))
    engine, algorithm, sync = FakeTrainEngine(lr=0.5), FakeAlgorithm(), FakeWeightSync()
    worker = TrainerWorker(
        "unused",
        queue,
        sync,
        trainer=TrainerConfig(micro_batch_tokens=12),
        temperature=1.0,
        group_size=GROUP,
        engine=engine,
        algorithm=algorithm,
    )
    worker.begin_step()
    for chunk in ([3, 0], [4], [1, 2]):  # the controller's order, not the ids'
        worker.add_groups(chunk)
    metrics = worker.finish_step()

    order = [s for g in (3, 0, 4, 1, 2) for s in groups[g]]
    accumulated = [uid for call in engine.calls if call[0] == "accumulate" for uid in call[1]]
    assert accumulated == [s.uid for s in order]
    assert [c[0] for c in engine.calls].count("finish_step") == 1 and engine.calls[0] == ("begin_step",)
    assert engine.calls[-1] == ("finish_step", 1.0 / algorithm.normaliser(order))
    want_w = 0.5 * sum(s.reward * sum(s.loss_mask) for s in order) / algorithm.normaliser(order)
    assert engine.w == pytest.approx(want_w)  # every micro-batch's gradient, scaled once
    assert sync.published == [(1, ("w",))] and float(sync.versions[1]["w"][0]) == pytest.approx(engine.w)
    assert metrics["version"] == 1.0 and worker.trained_ids() == [s.uid for s in order]
    read = [i for task, _, rows in queue.gets if task == TRAIN_TASK for i in rows]
    assert read == [i for g in (3, 0, 4, 1, 2) for i in range(g * GROUP, (g + 1) * GROUP)]  # each row once, in order
