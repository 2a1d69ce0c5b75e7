"""A TransferQueue task served by one worker: read ready rows, compute one column, write it back.

DESIGN.md's stages after generation are tasks that read some columns and write others. This is
the loop they share: ``serve`` pulls the rows of ``task`` whose input columns are ready (as
soon as rollout has written them, a few at a time), ``compute`` turns them into one value per
row, and ``put`` writes that as ``output`` to the same rows, which makes them ready for the
tasks that read it (the ``train`` task lists it among its inputs). It stops when the queue
closes. Subclasses say what to compute: the reference log-probs (``trainer/reference.py``), the
critic's values (``trainer/critic_task.py``). Deliberately not here: models, choosing rows for a
training step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from sluice.api import Batch, QueueClient, Sample
from sluice.queue.samples import SAMPLE_COLUMNS, rows_to_samples


class ColumnTaskWorker:
    """Serves ``task`` of ``queue``: writes ``output`` for every row as it becomes ready."""

    task: ClassVar[str]
    output: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = SAMPLE_COLUMNS
    """What the task reads: a whole written sample."""

    def __init__(self, queue: QueueClient, batch_rows: int) -> None:
        self.queue = queue
        self.batch_rows = batch_rows
        self.rows_done = 0

    def serve(self) -> int:
        """Write ``output`` for every row as it becomes ready, until the queue closes; returns
        the number of rows served."""
        while True:
            batch = self.queue.get(self.task, self.inputs, self.batch_rows, min_size=1)
            if not len(batch):  # closed
                return self.rows_done
            self.step(batch)

    def step(self, batch: Batch) -> None:
        """One batch of rows: ``compute`` over its samples (ascending index order), written back."""
        samples = rows_to_samples(batch)
        self.queue.put(sorted(batch.indices), {self.output: self.compute(batch, samples)})
        self.rows_done += len(samples)

    def compute(self, batch: Batch, samples: Sequence[Sample]) -> list[Any]:
        """One value of ``output`` per sample (``samples`` are ``batch``'s rows in index order)."""
        raise NotImplementedError
