"""The train worker: streams a step's groups out of the TransferQueue into gradient accumulation.

The controller hands it group ids in the step's canonical order (``add_group``); the worker
reads those rows from the queue itself (data never passes through the driver), computes the
group's advantages, and runs each micro-batch as soon as it is complete — cut in order by
``pack_in_order``, so the step is bit-identical to a whole-batch step over the same samples.
``finish_step`` scales by the step-wide normaliser, takes the optimizer step and publishes the
new weights. It is synchronous (a blocking queue read waits for the rows); the same class runs in a worker
thread (``backend: local``) or as a Ray actor. With data parallelism (``join_data_parallel``)
several workers each train the groups handed to them and combine gradients at ``finish_step``
(``trainer/data_parallel.py``); rank 0 publishes. It does not choose groups.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from sluice.api import Algorithm, MicroBatch, QueueClient, Sample, WeightSync
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.queue.samples import group_rows, rows_to_samples, train_columns
from sluice.telemetry.trace import SpanRecorder
from sluice.trainer.data_parallel import DataParallelGroup, free_tcp_address
from sluice.trainer.rng_state import capture_rng, restore_rng
from sluice.trainer.step import InOrderPacker, step_normaliser
from sluice.trainer.updates import ONE_UPDATE, UpdateSchedule, proximal_logprobs, train_global_batch

TRAIN_TASK = "train"
TRAINER_STATE = "trainer_state.pt"


class TrainerWorker:
    """Owns the train engine; consumes groups from the ``train`` task of the queue."""

    def __init__(
        self,
        model_dir: str | Path,
        queue: QueueClient,
        algorithm: Algorithm,
        weight_sync: WeightSync,
        *,
        group_size: int,
        micro_batch_tokens: int,
        engine_kwargs: dict[str, Any],
        schedule: UpdateSchedule = ONE_UPDATE,
        threads: int = 1,
        trace: bool = True,
    ) -> None:
        torch.set_num_threads(threads)
        self.engine = HFTrainEngine(load_causal_lm(model_dir), **engine_kwargs)
        self.queue = queue
        self.algorithm = algorithm
        self.weight_sync = weight_sync
        self.group_size = group_size
        self.micro_batch_tokens = micro_batch_tokens
        self.schedule = schedule
        self.tracer = SpanRecorder("trainer", enabled=trace)
        self.version = 0
        self._step: InOrderPacker | None = None
        self._held: list[Sample] = []
        self._timing: dict[str, float] = {}
        self._trained_uids: list[str] = []
        self.dp: DataParallelGroup | None = None

    def rendezvous_address(self) -> str:
        """Where the data-parallel ranks meet (asked of rank 0, on its node)."""
        return free_tcp_address()

    def join_data_parallel(self, address: str, rank: int, world_size: int) -> None:
        """Join the trainer ranks' process group; blocks until every rank has joined."""
        if not self.schedule.streams:
            raise ValueError("data-parallel training needs ppo_mini_batches = ppo_epochs = 1 and prox_logprobs: behav")
        self.dp = DataParallelGroup(address, rank, world_size)
        if rank > 0:  # rank 0 keeps the name the trace summary reads as "the trainer"
            self.tracer = SpanRecorder(f"trainer{rank}", enabled=self.tracer.enabled)

    def begin_step(self) -> None:
        self._step = InOrderPacker(self.micro_batch_tokens)
        self._held = []
        self._timing = {"wait_data_s": 0.0, "first_microbatch_at": 0.0}
        self.engine.begin_step()

    def add_groups(self, group_ids: list[int]) -> None:
        """Read these groups' rows (one queue read, waiting until they are ready), then train every
        micro-batch they complete; samples enter in the given group order."""
        assert self._step is not None, "begin_step first"
        start = time.perf_counter()
        with self.tracer.span("wait_data", lane="trainer", groups=len(group_ids)):
            rows = [i for gid in group_ids for i in group_rows(gid, self.group_size)]
            columns = train_columns(self.algorithm.uses_reference)
            batch = self.queue.get(TRAIN_TASK, columns, len(rows), indices=rows, min_size=len(rows))
        self._timing["wait_data_s"] += time.perf_counter() - start
        position = {gid: k for k, gid in enumerate(group_ids)}
        samples = sorted(rows_to_samples(batch), key=lambda s: position[s.group_id])
        if self.algorithm.whole_batch_advantages or not self.schedule.streams:  # needs the whole step
            self._held.extend(samples)
            return
        prox = proximal_logprobs(self.engine, samples, self.schedule, self.engine.temperature)
        for mb in self._step.add(samples, self.algorithm.advantages(samples), prox):
            self._accumulate(mb)

    def finish_step(self) -> dict[str, float]:
        """Flush, scale by the step-wide normaliser, optimizer step, publish version ``v + 1``."""
        assert self._step is not None, "begin_step first"
        held, self._held = self._held, []
        if not self.schedule.streams:
            with self.tracer.span("optimizer_step", lane="trainer", updates=self.schedule.updates):
                metrics = train_global_batch(
                    self.engine, held, self.algorithm, self.micro_batch_tokens, self.schedule, self.engine.temperature
                )
            return self._publish(metrics, held)
        prox = proximal_logprobs(self.engine, held, self.schedule, self.engine.temperature)
        if held or (self.dp is not None and self.algorithm.whole_batch_advantages):  # every rank gathers
            for mb in self._step.add(held, self._held_advantages(held), prox):
                self._accumulate(mb)
        for mb in self._step.flush():
            self._accumulate(mb)
        with self.tracer.span("optimizer_step", lane="trainer"):
            step_samples = self._everyone(self._step.samples)
            if self.dp is not None:
                self.dp.all_reduce_grads(self.engine.model.parameters())
            metrics = self.engine.finish_step(grad_scale=1.0 / step_normaliser(step_samples, self.algorithm))
            if self.dp is not None:
                metrics = self.dp.sum_metrics(metrics)
        return self._publish(metrics, step_samples)

    def _everyone(self, samples: list[Sample]) -> list[Sample]:
        """The whole step's samples over all data-parallel ranks (rank order); ``samples`` alone."""
        if self.dp is None:
            return samples
        return [s for part in self.dp.all_gather(samples) for s in part]

    def _held_advantages(self, held: list[Sample]) -> list[list[float]]:
        """Advantages of held samples: whole-batch estimators see every rank's samples."""
        if self.dp is None or not self.algorithm.whole_batch_advantages:
            return self.algorithm.advantages(held)
        parts = self.dp.all_gather(held)
        offset = sum(len(p) for p in parts[: self.dp.rank])
        return self.algorithm.advantages([s for p in parts for s in p])[offset : offset + len(held)]

    def _publish(self, metrics: dict[str, float], samples: list[Sample]) -> dict[str, float]:
        """Version ``v + 1``: publish the weights, close the step, report."""
        self.version += 1
        if self.dp is None or self.dp.rank == 0:
            with self.tracer.span("weight_publish", lane="trainer", version=self.version):
                self.weight_sync.publish(self.engine.export_weights(), self.version)
        trained = sum(len(s.response_ids) for s in samples)
        self._trained_uids = [s.uid for s in samples]
        self._step = None
        return {
            "optimizer_steps": 1.0,
            **metrics,
            **self._timing,
            "trained_tokens": float(trained),
            "version": float(self.version),
        }

    def weights_fingerprint(self) -> tuple[int, float]:
        """(version, float64 sum of every parameter): compared with the engines' after a sync."""
        if self.engine.lora is not None:  # what the engines hold: the merged weights, tied ones once
            unique = {id(t): t for t in self.engine.export_weights().values()}
            return self.version, float(sum(t.double().sum() for t in unique.values()))
        with torch.no_grad():
            return self.version, float(sum(p.double().sum() for p in self.engine.model.parameters()))

    def save(self, path: str) -> None:
        self.engine.save(path)

    def trained_ids(self) -> list[str]:
        """Ids (``Sample.uid``) of the samples the last finished step trained, every rank's."""
        return list(self._trained_uids)

    def save_state(self, path: str) -> None:
        """Checkpoint between steps: weights and optimizer (``path`` becomes an HF folder), this
        process's RNG and the policy version."""
        assert self._step is None, "checkpoint between steps only"
        self.engine.save(path)
        torch.save({"version": self.version, "rng": capture_rng()}, Path(path) / TRAINER_STATE)

    def load_state(self, path: str) -> int:
        """Resume from ``save_state``; rank 0 republishes the weights as the restored version so
        the engines can load them. Returns the version."""
        self.engine.load(path)
        state = torch.load(Path(path) / TRAINER_STATE, weights_only=False)  # our own file: RNG tuples
        self.version = int(state["version"])
        restore_rng(state["rng"])
        if self.dp is None or self.dp.rank == 0:
            self.weight_sync.publish(self.engine.export_weights(), self.version)
        return self.version

    def drain_trace(self) -> list[dict[str, Any]]:
        return self.tracer.drain()

    def _accumulate(self, mb: MicroBatch) -> None:
        if not self._timing["first_microbatch_at"]:
            self._timing["first_microbatch_at"] = time.time()
        with self.tracer.span("train_microbatch", lane="trainer", samples=len(mb.samples)):
            self.engine.accumulate(mb, self.algorithm)
