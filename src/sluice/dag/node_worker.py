"""One generic worker for a DAG node after generation: read ready rows, apply the node, write back.

DESIGN.md's stages after generation are tasks that read some columns and write others. A
``NodeTaskWorker`` serves one node's TransferQueue task in every mode and placement (a thread
with ``run.backend: local``, a Ray actor on ``ray``): ``serve`` pulls rows whose ``node.reads``
are ready (as soon as rollout or an earlier node has written them, a few at a time), applies the
node's function (``dag/functions.py``: a built-in such as ``reference_logprobs`` or
``critic_values``, or a user function) to them in ascending row order, and writes
``node.writes`` back to the same rows, which makes them ready for the tasks that read those
columns. It stops when the queue closes.

The node's ``role`` says which model it holds, built in the worker's own process: ``reference``
a frozen copy of the initial policy; ``critic`` a copy of the critic that loads the newest
version the trainer publishes before each batch, never older than the version that generated the
rows (at η = 0 exactly the critic the step trains from); ``reward`` / ``custom`` none.

Deliberately not here: choosing rows for a training step, the trainer's nodes (advantages and
updates run inside the trainer's step), what the node functions compute.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from sluice.api import Batch, QueueClient, Shard, WeightSync
from sluice.config import TrainerConfig
from sluice.dag.functions import NodeContext, apply_node, resolve_function
from sluice.dag.model_nodes import ModelBindings
from sluice.dag.spec import DagError, DagNode
from sluice.trainer.sections import critic_of, frozen_engine

WEIGHT_POLL_S = 0.005
NO_MODEL_ROLES = ("reward", "custom")


class NodeTaskWorker:
    """Serves ``node``'s queue task (``task``, default the node's id) of ``queue``."""

    def __init__(
        self,
        node: DagNode,
        queue: QueueClient,
        *,
        task: str | None = None,
        model_dir: str | Path | None = None,
        trainer: TrainerConfig | None = None,
        temperature: float = 1.0,
        critic_sync: WeightSync | None = None,
        batch_rows: int = 64,
        threads: int = 1,
        wait_s: float = 600.0,
    ) -> None:
        torch.set_num_threads(threads)
        self.node = node
        self.task = task or node.id
        self.queue = queue
        self.batch_rows = batch_rows
        self.function = resolve_function(node)
        self.critic_sync = critic_sync if node.role == "critic" else None
        self.wait_s = wait_s
        self.context = NodeContext(node, models=self._models(model_dir, trainer or TrainerConfig(), temperature))
        self.rows_done = 0

    def _models(self, model_dir: str | Path | None, trainer: TrainerConfig, temperature: float) -> Any:
        role = self.node.role
        if role in NO_MODEL_ROLES:
            return None
        if model_dir is None:
            raise DagError(f"node {self.node.id!r} ({role}) needs the model folder")
        bindings = ModelBindings(None, 0, None, temperature)
        critic = critic_of(trainer)
        if role == "reference":
            bindings.reference = frozen_engine(model_dir, trainer, temperature)
        elif role == "critic" and critic is not None and self.critic_sync is not None:
            bindings.critic = critic.engine(model_dir)  # version 0: every build of the critic is the same
            bindings.critic.model.requires_grad_(False)
        else:
            raise DagError(f"node {self.node.id!r}: a {role!r} node runs inside the trainer, not in a worker")
        return bindings

    def serve(self) -> int:
        """Write the node's columns for every row as it becomes ready, until the queue closes;
        returns the number of rows served."""
        while True:
            batch = self.queue.get(self.task, self.node.reads, self.batch_rows, min_size=1)
            if not len(batch):  # closed
                return self.rows_done
            self.step(batch)

    def serve_steps(self, rank: int, size: int, rows_per_step: int, first: int, steps: int) -> int:
        """A multi-controller run's node at data-parallel size ``size``: for each step from
        ``first`` on, read this rank's token-balanced shard of the step's queue partition (the
        queue's redistribution between stages of different sizes), apply the node, write back.
        Returns the rows served (fewer if the queue closed first)."""
        for step in range(first, steps):
            shard = Shard(rank, size)
            batch = self.queue.get(self.task, self.node.reads, rows_per_step, partition=step, shard=shard)
            if not len(batch):  # closed
                break
            self.step(batch)
        return self.rows_done

    def step(self, batch: Batch) -> None:
        """One batch of rows, in ascending row order: the node's columns, written back."""
        rows = in_row_order(batch)
        if self.critic_sync is not None:
            self.load_newest_critic(max(m.version for m in rows.meta))
        out = apply_node(self.function, self.context, rows, len(rows))
        self.queue.put(list(rows.indices), {c: list(v) for c, v in out.items()})
        self.rows_done += len(rows)

    def load_newest_critic(self, at_least: int) -> None:
        """Load the newest published critic, waiting until it is at least version ``at_least``."""
        assert self.critic_sync is not None
        deadline = time.monotonic() + self.wait_s
        while max(self.context.version, self.critic_sync.latest_version()) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"critic version {at_least} was not published within {self.wait_s} s")
            time.sleep(WEIGHT_POLL_S)
        newest = self.critic_sync.latest_version()
        if newest > self.context.version:
            self.context.models.critic.load_weights(self.critic_sync.fetch(newest))
            self.context.version = newest


def in_row_order(batch: Batch) -> Batch:
    """``batch`` with its rows sorted by index (the order ``rows_to_samples`` returns)."""
    order = sorted(range(len(batch)), key=lambda k: batch.indices[k])
    if order == list(range(len(batch))):
        return batch
    columns = {c: [values[k] for k in order] for c, values in batch.columns.items()}
    return Batch(tuple(batch.indices[k] for k in order), columns, tuple(batch.meta[k] for k in order))
