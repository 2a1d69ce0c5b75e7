"""A ``torch.utils.data.IterableDataset`` over one task of the TransferQueue (AsyncFlow §3.4).

Each item is a ``Batch`` from ``client.get``: wrap it as ``DataLoader(dataset, batch_size=None)``
so the loader neither re-batches nor collates. Iteration ends after ``stop_after`` rows, or when
a ``get`` comes back empty (its ``timeout`` passed with nothing ready, or the queue was closed).

Use it with ``num_workers=0``. Worker processes need a client that crosses processes
(``RayQueue``, never ``LocalQueue``, whose copy in a worker would be a different queue) and the
``spawn`` start method (Ray is not fork-safe); each worker then runs its own loop, and the
controller still hands every row to exactly one of them. It deliberately keeps no replay
buffer and does not split batches into micro-batches (the trainer does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from torch.utils.data import IterableDataset

from sluice.api.queue import Batch, Policy, QueueClient

logger = logging.getLogger(__name__)


class QueueIterableDataset(IterableDataset[Batch]):
    """Streams ``Batch``es of ``columns`` for ``task`` until ``stop_after`` rows or an empty get."""

    def __init__(
        self,
        client: QueueClient,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        policy: str | Policy = "fifo",
        stop_after: int | None = None,
        timeout: float | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.client = client
        self.task = task
        self.columns = list(columns)
        self.batch_size = batch_size
        self.policy = policy
        self.stop_after = stop_after
        self.timeout = timeout

    def __iter__(self) -> Iterator[Batch]:
        served = 0
        while self.stop_after is None or served < self.stop_after:
            want = self.batch_size if self.stop_after is None else min(self.batch_size, self.stop_after - served)
            batch = self.client.get(self.task, self.columns, want, policy=self.policy, timeout=self.timeout)
            if len(batch) == 0:
                logger.debug("task %s: empty get after %d rows, stopping", self.task, served)
                return
            served += len(batch)
            yield batch
