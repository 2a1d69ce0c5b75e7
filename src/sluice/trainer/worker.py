"""The train worker: reads a step's groups out of the TransferQueue and hands them to the RL step.

The controller hands it group ids in the step's canonical order (``add_groups``); the worker
reads those rows from the queue itself (data never passes through the driver) and gives the
samples to the step (``trainer/rl_step.py``: ``RLStep``, the one implementation of an RL step),
which streams each micro-batch as soon as it is complete or holds the step for its updates.
``finish_step`` takes the step's optimizer update(s) and publishes the new weights. It is
synchronous (a blocking queue read waits for the rows); the same class runs in a worker thread
(``backend: local``) or as a Ray actor. With data parallelism (``join_data_parallel``) several
workers each train the groups handed to them, told each group's place in the step, and their
engine sums gradients before every optimizer update as ``trainer.strategy`` says (``ddp``,
``fsdp2``: ``engines/strategies.py``); rank 0 publishes (under ``fsdp2`` every rank takes part
in gathering the weights, bucket by bucket, and in writing a checkpoint, each its shard). With
a critic (``algorithm: ppo``) the rows also carry the critic-values task's ``values`` column;
the critic is published before the policy (the critic-values node worker,
``dag/node_worker.py``, loads it). A multi-controller step reads its rank's partition of the
queue instead (``train_partition``). It does not choose groups.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from sluice.api import Algorithm, Batch, QueueClient, Sample, Shard, TrainEngine, WeightSync
from sluice.config import TrainerConfig
from sluice.config.resources import TrainerResources
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.strategies import GatheredWeights, full_tensor
from sluice.queue.samples import group_rows, rows_to_samples, train_columns
from sluice.queue.shards import balance_shards
from sluice.telemetry.samples import SampleSummary, summarize_samples
from sluice.telemetry.trace import SpanRecorder
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.losses.common import off_policy_metrics
from sluice.trainer.ppo import VALUES_COLUMN
from sluice.trainer.rendezvous import free_tcp_address
from sluice.trainer.rl_step import RLStep
from sluice.trainer.rng_state import capture_rng, restore_rng
from sluice.trainer.sections import algorithm_of, critic_of, schedule_of, train_engine

TRAIN_TASK = "train"
TRAINER_STATE = "trainer_state.pt"


class TrainerWorker:
    """Owns the train engine; consumes groups from the ``train`` task of the queue."""

    def __init__(
        self,
        model_dir: str | Path,
        queue: QueueClient,
        weight_sync: WeightSync,
        *,
        trainer: TrainerConfig,
        temperature: float,
        group_size: int,
        steps: int = 0,
        threads: int = 1,
        resources: TrainerResources | None = None,
        trace: bool = True,
        trace_max_events: int | None = None,
        critic_sync: WeightSync | None = None,
        reward_column: str | None = None,
        engine: TrainEngine | None = None,
        algorithm: Algorithm | None = None,
        check_weights: bool = False,
    ) -> None:
        torch.set_num_threads(threads)
        self.check_weights = check_weights
        """Report each published version's checksum (``run.check_weights``)."""
        self.engine: TrainEngine = engine or train_engine(model_dir, trainer, temperature, steps)
        """The policy's train engine (``engine`` / ``algorithm``: ones built elsewhere, e.g. a test's fakes)."""
        self.temperature = temperature
        """The rollout's sampling temperature: log-probs are taken at it (``steps``: the run's, which
        the LR schedule spans)."""
        critic = critic_of(trainer)
        self.critic_spec = critic
        self.critic = critic.engine(model_dir) if critic is not None else None
        self.critic_sync = critic_sync
        if (critic is None) != (critic_sync is None):
            raise ValueError("a critic needs a critic_sync to publish it to the critic-values task, and only then")
        self.queue = queue
        self.algorithm: Algorithm = algorithm or algorithm_of(trainer)
        self.weight_sync = weight_sync
        self.group_size = group_size
        self.micro_batch_tokens = trainer.micro_batch_tokens
        self.schedule = schedule_of(trainer)
        self.reward_column = reward_column
        """A column a node of the DAG wrote (e.g. a combined reward) that replaces ``reward``."""
        self.tracer = SpanRecorder("trainer", enabled=trace, max_events=trace_max_events)
        self.version = 0
        self._step: RLStep | None = None
        self._trained_uids: list[str] = []
        self._trained: list[Sample] = []
        """The last finished step's samples, every rank's (``trained_samples`` shows a few)."""
        self.dp: DataParallelGroup | None = None
        self.strategy = trainer.strategy
        self.cpu_offload = trainer.cpu_offload
        if self.strategy != "single" and (resources or TrainerResources()).ranks == 1:  # one rank of its own group
            self.join_data_parallel(free_tcp_address(), 0, 1)

    def rendezvous_address(self, host: str) -> str:
        """Where the data-parallel ranks meet (asked of rank 0, on its node; ``host``: the node's
        address as the cluster knows it)."""
        return free_tcp_address(host)

    def join_data_parallel(self, address: str, rank: int, world_size: int) -> None:
        """Join the trainer ranks' process group; blocks until every rank has joined."""
        assert isinstance(self.engine, HFTrainEngine), "data parallelism distributes a torch engine"
        self.dp = DataParallelGroup(address, rank, world_size, self.engine.device)
        self.engine.distribute(self.strategy, cpu_offload=self.cpu_offload)
        if self.critic is not None:
            self.critic.distribute(self.strategy, cpu_offload=self.cpu_offload)
        if rank > 0:  # rank 0 keeps the name the trace summary reads as "the trainer"
            self.tracer = SpanRecorder(f"trainer{rank}", enabled=self.tracer.enabled, max_events=self.tracer.max_events)

    def begin_step(self, hold: bool = False) -> None:
        """Open the next step (``hold``: train it whole at ``finish_step``, never streamed)."""
        critic = (self.critic, self.critic_spec) if self.critic is not None and self.critic_spec is not None else None
        self._step = RLStep(
            self.engine, self.algorithm, self.schedule, self.micro_batch_tokens, self.temperature, self.tracer,
            critic=critic, dp=self.dp, hold=hold or self.strategy == "fsdp2",
        )  # fmt: skip

    def add_groups(self, group_ids: list[int], positions: list[int] | None = None) -> None:
        """Read these groups' rows (one queue read, waiting until they are ready) and hand them to
        the step, which trains every micro-batch they complete when it streams; samples enter in
        the given group order. ``positions``: each group's place in the whole step (data
        parallelism; default: after this worker's groups)."""
        assert self._step is not None, "begin_step first"
        start = time.perf_counter()
        with self.tracer.span("wait_data", lane="trainer", groups=len(group_ids)):
            rows = [i for gid in group_ids for i in group_rows(gid, self.group_size)]
            batch = self.queue.get(TRAIN_TASK, self._columns(), len(rows), indices=rows, min_size=len(rows))
        self._step.timing["wait_data_s"] += time.perf_counter() - start
        position = {gid: k for k, gid in enumerate(group_ids)}
        samples, values = self._samples_of(batch)
        paired = sorted(zip(samples, values, strict=True), key=lambda p: position[p[0].group_id])
        where = dict(zip(group_ids, positions, strict=True)) if positions is not None else None
        self._step.add([s for s, _ in paired], [v for _, v in paired], where)

    def train_partition(self, step: int, rows: int, timeout: float | None = None) -> dict[str, float]:
        """A multi-controller step (``run.controller: multi``): read this rank's shard of queue
        partition ``step`` (``rows`` rows in all; the queue splits them over the data-parallel
        ranks by tokens, DistFlow's redistribution), then train the whole step (a group may
        straddle ranks: the step is held, its advantages come from every rank's rows) and publish."""
        self.begin_step(hold=True)  # a straddled group's advantages need every rank's rows
        assert self._step is not None
        rank, size = (self.dp.rank, self.dp.world_size) if self.dp is not None else (0, 1)
        start = time.perf_counter()
        with self.tracer.span("wait_data", lane="trainer", step=step):
            batch = self.queue.get(
                TRAIN_TASK, self._columns(), rows, partition=step, shard=Shard(rank, size), timeout=timeout
            )
        self._step.timing["wait_data_s"] += time.perf_counter() - start
        owed = len(balance_shards([1] * rows, size)[rank])
        if len(batch) != owed:
            raise TimeoutError(f"trainer rank {rank}: {len(batch)} of step {step}'s {owed} rows within {timeout} s")
        samples, values = self._samples_of(batch)
        order = sorted(range(len(samples)), key=lambda k: (samples[k].group_id, samples[k].uid))
        in_order = [samples[k] for k in order]
        self._step.add(in_order, [values[k] for k in order], {s.group_id: s.group_id for s in in_order})
        return self.finish_step()

    def _columns(self) -> tuple[str, ...]:
        columns = train_columns(self.algorithm.uses_reference) + ((VALUES_COLUMN,) if self.critic else ())
        return columns + ((self.reward_column,) if self.reward_column else ())

    def _samples_of(self, batch: Batch) -> tuple[list[Sample], list[list[float]]]:
        """The batch's samples in row order, with the DAG's reward column in place of the
        rollout's (if any), and their critic values (empty without a critic)."""
        in_order = sorted(range(len(batch)), key=lambda k: batch.indices[k])  # rows_to_samples' order
        values = [list(batch.columns[VALUES_COLUMN][k]) for k in in_order] if self.critic else [[]] * len(batch)
        samples = rows_to_samples(batch)
        if self.reward_column:  # the DAG's reward for the advantages, in place of the rollout's
            rewards = [float(batch.columns[self.reward_column][k]) for k in in_order]
            samples = [dataclasses.replace(s, reward=r) for s, r in zip(samples, rewards, strict=True)]
        return samples, values

    def finish_step(self) -> dict[str, float]:
        """The step's optimizer update(s) (``RLStep``), then publish version ``v + 1``."""
        assert self._step is not None, "begin_step first"
        metrics, step_samples = self._step.finish()
        return self._publish(metrics, step_samples)

    def _publish(self, metrics: dict[str, float], samples: list[Sample]) -> dict[str, float]:
        """Version ``v + 1``: publish the weights, close the step, report."""
        self.version += 1
        self._publish_weights()
        if self.check_weights:  # fsdp2: every rank takes part in the gather, as in the publish
            metrics = {**metrics, "weights_checksum": self.weights_fingerprint()[1]}
        trained = sum(len(s.response_ids) for s in samples)
        if self.reward_column:  # the reward the advantages saw, beside the rollout's ``reward_mean``
            mean = sum(s.reward for s in samples) / max(len(samples), 1)
            metrics = {**metrics, f"{self.reward_column}_mean": mean}
        self._trained_uids = [s.uid for s in samples]
        self._trained = samples
        timing = self._step.timing if self._step is not None else {}
        self._step = None
        return {
            "optimizer_steps": 1.0,
            **metrics,
            **off_policy_metrics(metrics),
            **timing,
            "trained_tokens": float(trained),
            "version": float(self.version),
        }

    def _publish_weights(self) -> None:
        """Rank 0 publishes this version (the critic first); under ``fsdp2`` the other ranks take
        their part in gathering the weights and drop them."""
        if self.dp is not None and self.dp.rank > 0:
            if self.strategy == "fsdp2":  # in rank 0's order: the critic, then the policy
                exports = [self.critic.export_weights()] if self.critic is not None else []
                for weights in [*exports, self.engine.export_weights()]:
                    assert isinstance(weights, GatheredWeights)
                    weights.drain()
            return
        with self.tracer.span("weight_publish", lane="trainer", version=self.version):
            self._publish_critic()
            self.weight_sync.publish(self.engine.export_weights(), self.version)

    def _publish_critic(self) -> None:
        """The critic of this version, before the policy: rows its policy generates find it."""
        if self.critic is not None and self.critic_sync is not None:
            self.critic_sync.publish(self.critic.export_weights(), self.version)

    def weights_fingerprint(self) -> tuple[int, float]:
        """(version, float64 sum of every parameter): compared with the engines' after a sync."""
        if not isinstance(self.engine, HFTrainEngine) or self.engine.lora is not None:  # merged, tied once
            unique = {id(t): t for t in self.engine.export_weights().values()}
            return self.version, float(sum(t.double().sum() for t in unique.values()))
        with torch.no_grad():
            params = self.engine.model.parameters()  # fsdp2: gathered (every rank calls this together)
            return self.version, float(sum(full_tensor(p).double().sum() for p in params))

    def save(self, path: str) -> None:
        """The policy as an HF model folder: only what ``from_pretrained`` needs (no optimizer state)."""
        self.engine.save(path, optimizer=False)

    def trained_ids(self) -> list[str]:
        """Ids (``Sample.uid``) of the samples the last finished step trained, every rank's."""
        return list(self._trained_uids)

    def trained_samples(self, count: int) -> list[SampleSummary]:
        """``count`` of the last finished step's samples, spread over it, as token ids and numbers
        (small: what a Ray trainer returns for the run's ``samples.jsonl``)."""
        return summarize_samples(self._trained, count)

    def save_state(self, path: str) -> None:
        """Checkpoint between steps: weights and optimizer (``path`` becomes an HF folder), this
        process's RNG and the policy version."""
        assert self._step is None, "checkpoint between steps only"
        self.engine.save(path)  # every rank calls it: under fsdp2 each writes its shard
        if self.critic is not None:
            self.critic.save(path)  # likewise
        if self.dp is not None and self.dp.rank > 0:
            return
        torch.save({"version": self.version, "rng": capture_rng()}, Path(path) / TRAINER_STATE)

    def load_state(self, path: str) -> int:
        """Resume from ``save_state``; rank 0 republishes the weights as the restored version so
        the engines can load them. Returns the version."""
        self.engine.load(path)
        if self.critic is not None:
            self.critic.load(path)
        state = torch.load(Path(path) / TRAINER_STATE, weights_only=True)
        self.version = int(state["version"])
        restore_rng(state["rng"])
        self._publish_weights()
        return self.version

    def drain_trace(self) -> list[dict[str, Any]]:
        return self.tracer.drain()
