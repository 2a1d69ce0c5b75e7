"""The in-process TransferQueue: storage units and per-task controllers in one process.

``LocalQueue`` implements ``QueueClient`` for threads; ``AsyncLocalQueue`` wraps the same state as
``AsyncQueueClient`` for asyncio code. Both may be used at once. One lock guards all state; a
put writes the storage units (row ``i`` on unit ``i % num_storage_units``) and then notifies every
controller of the (rows, columns) it made ready, which wakes waiting readers: a thread waits on
an ``Event``, a coroutine on a future resolved with ``call_soon_threadsafe``. Nothing polls.

Freeing: ``clear()`` frees the rows every registered task consumed (the driver calls it at step
boundaries); with ``free_consumed=True`` that happens on its own as soon as the last task reads a
row, so memory stays bounded by the rows in flight. A freed index is never reused: later writes
to it are ignored (a task writing an output column after everyone else is done cannot resurrect
half a row). Register every task before its rows can be freed.

It deliberately does not cross process boundaries (see ``ray_backend``) and does not copy object
values on put (variable-length numeric columns are packed, other objects stored by reference).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.api.queue import Batch, Partition, Policy, RowMeta, Shard, StorageUnit
from sluice.queue.controller import TaskController, Waiter
from sluice.queue.lifecycle import ConsumptionLedger, common_rows
from sluice.queue.packed import MetaRows, meta_array
from sluice.queue.request import (
    ReadRequest,
    check_put,
    deadline_of,
    is_done,
    remaining,
    resolve,
    select,
)
from sluice.queue.storage import (
    InMemoryStorageUnit,
    group_by_columns,
    merge_reads,
    merge_snapshots,
    placement,
    select_rows,
    split_snapshot,
    with_partition,
)

logger = logging.getLogger(__name__)


class LocalQueue:
    """Thread-safe in-process TransferQueue (implements ``sluice.api.queue.QueueClient``)."""

    def __init__(
        self,
        num_storage_units: int = 1,
        unit_factory: Callable[[], StorageUnit] | None = None,
        free_consumed: bool = False,
    ) -> None:
        if num_storage_units < 1:
            raise ValueError("num_storage_units must be >= 1")
        make = unit_factory or (lambda: InMemoryStorageUnit(num_units=num_storage_units))
        self._units: list[StorageUnit] = [make() for _ in range(num_storage_units)]
        self._controllers: dict[str, TaskController] = {}
        self._partitions: dict[int, int] = {}  # declared partition id -> expected rows
        self._ledger = ConsumptionLedger() if free_consumed else None
        self._lock = threading.Lock()
        self._closed = False

    def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        """Create the task's controller and show it every row already written (idempotent)."""
        with self._lock:
            existing = self._controllers.get(task)
            if existing is not None:
                if existing.input_columns != tuple(dict.fromkeys(input_columns)):
                    raise ValueError(f"task {task!r} already registered with {existing.input_columns}")
                return
            ctl = self._controllers[task] = TaskController(task, input_columns)
            ctl.declare(self._partitions)
            for unit in self._units:
                bootstrap(ctl, unit.catalog())

    def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None:
        check_put(indices, columns, meta)
        if partition is not None:
            meta = with_partition(indices, meta, partition)
        names = list(columns)
        metas = None if meta is None else meta_array(meta)
        shares = [  # packed outside the lock
            (
                unit,
                [indices[p] for p in positions],
                select_rows(columns, positions, pack=True),
                None if metas is None else MetaRows(metas[positions]),
            )
            for unit, positions in placement(indices, len(self._units)).items()
        ]
        with self._lock:
            if partition is not None:
                declare(self._partitions, partition)
                for ctl in self._controllers.values():
                    ctl.declare({partition.id: partition.expected_rows})
            for unit, sub_indices, sub_columns, sub_meta in shares:
                written = self._units[unit].write(sub_indices, sub_columns, sub_meta)
                for ctl in self._controllers.values():
                    ctl.notify_ready(written, names)

    def get(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        policy: str | Policy = "fifo",
        indices: Sequence[int] | None = None,
        min_size: int | None = None,
        timeout: float | None = None,
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> Batch:
        req = ReadRequest.of(task, columns, batch_size, policy, indices, min_size, partition, shard)
        deadline = deadline_of(timeout)
        event = threading.Event()
        waiter = event.set
        while True:
            event.clear()
            batch = self.attempt(req, deadline, waiter)
            if batch is not None:
                return batch
            try:
                event.wait(remaining(deadline))
            finally:
                self.unwatch(task, waiter)

    def attempt(self, req: ReadRequest, deadline: float | None, waiter: Waiter) -> Batch | None:
        """One selection attempt; if it must wait, ``waiter`` is registered in the same critical section."""
        with self._lock:
            ctl = self._controller(req.task)
            metas = select(ctl, req, self._closed, deadline)
            if metas is None:
                ctl.add_waiter(waiter)
                return None
            chosen = [m.index for m in metas]
            positions = placement(chosen, len(self._units))
            parts = {u: self._units[u].read([chosen[p] for p in pos], req.columns) for u, pos in positions.items()}
            data = merge_reads(parts, positions, req.columns, len(chosen))
            done = is_done(ctl, req, self._closed, len(chosen))
            if self._ledger is not None:
                self._free(self._ledger.consumed(req.task, chosen, self._controllers))
            return Batch(indices=tuple(chosen), columns=data, meta=tuple(metas), done=done)

    def unwatch(self, task: str, waiter: Waiter) -> None:
        with self._lock:
            self._controller(task).remove_waiter(waiter)

    def _controller(self, task: str) -> TaskController:
        ctl = self._controllers.get(task)
        if ctl is None:
            raise KeyError(f"task {task!r} is not registered")
        return ctl

    def _free(self, indices: Sequence[int]) -> int:
        """Drop rows from storage and from every controller (lock held)."""
        dropped = 0
        for unit, positions in placement(indices, len(self._units)).items():
            dropped += self._units[unit].drop([indices[p] for p in positions])
        for ctl in self._controllers.values():
            ctl.forget(indices)
        if self._ledger is not None:
            self._ledger.forget(indices)
        return dropped

    def clear(self, indices: Sequence[int] | None = None) -> int:
        with self._lock:
            if indices is None:
                consumed = [ctl.consumed for ctl in self._controllers.values()]
                indices = common_rows(consumed)
            return self._free(indices)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "storage": merge_snapshots([unit.snapshot() for unit in self._units]),
                "tasks": {task: ctl.snapshot() for task, ctl in self._controllers.items()},
                "partitions": sorted(self._partitions.items()),
                "ledger": [] if self._ledger is None else self._ledger.snapshot(),
            }

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            for unit, part in zip(self._units, split_snapshot(state["storage"], len(self._units)), strict=True):
                unit.restore(part)
            self._partitions.update((pid, n) for pid, n in state["partitions"])
            if self._ledger is not None:
                self._ledger.restore(state["ledger"])
            for task, ctl_state in state["tasks"].items():
                ctl = self._controllers.get(task) or TaskController(task, ctl_state["input_columns"])
                ctl.restore(ctl_state)
                self._controllers[task] = ctl

    def stats(self) -> dict[str, Any]:
        with self._lock:
            units = [unit.stats() for unit in self._units]
            return {
                "rows": sum(u["rows"] for u in units),
                "units": units,
                "tasks": {task: ctl.stats() for task, ctl in self._controllers.items()},
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for ctl in self._controllers.values():
                ctl.wake()


def declare(partitions: dict[int, int], part: Partition) -> None:
    """Record a partition's expected row count; a different count for a known id is an error."""
    known = partitions.setdefault(part.id, part.expected_rows)
    if known != part.expected_rows:
        raise ValueError(f"partition {part.id} declared with {part.expected_rows} rows, earlier with {known}")


def bootstrap(ctl: TaskController, catalog: Sequence[tuple[RowMeta, tuple[str, ...]]]) -> None:
    """Show a new controller the rows a storage unit already holds."""
    for names, metas in group_by_columns(catalog).items():
        ctl.notify_ready(metas, names)


class AsyncLocalQueue:
    """``LocalQueue`` as coroutines (implements ``sluice.api.queue.AsyncQueueClient``).

    Puts and selections run inline (they are short and never wait); only ``get`` suspends, on a
    future that the controller resolves when a write may have made rows selectable.
    """

    def __init__(self, queue: LocalQueue | None = None) -> None:
        self.queue = queue if queue is not None else LocalQueue()

    async def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        self.queue.register_task(task, input_columns)

    async def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        meta: Sequence[RowMeta] | None = None,
        *,
        partition: Partition | None = None,
    ) -> None:
        self.queue.put(indices, columns, meta, partition=partition)

    async def get(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        policy: str | Policy = "fifo",
        indices: Sequence[int] | None = None,
        min_size: int | None = None,
        timeout: float | None = None,
        partition: int | None = None,
        shard: Shard | None = None,
    ) -> Batch:
        req = ReadRequest.of(task, columns, batch_size, policy, indices, min_size, partition, shard)
        loop = asyncio.get_running_loop()
        deadline = deadline_of(timeout)
        while True:
            fut: asyncio.Future[None] = loop.create_future()

            def waiter(fut: asyncio.Future[None] = fut) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(resolve, fut)

            batch = self.queue.attempt(req, deadline, waiter)
            if batch is not None:
                return batch
            try:
                await asyncio.wait([fut], timeout=remaining(deadline))
            finally:
                self.queue.unwatch(task, waiter)

    async def clear(self, indices: Sequence[int] | None = None) -> int:
        return self.queue.clear(indices)

    async def snapshot(self) -> dict[str, Any]:
        return self.queue.snapshot()

    async def restore(self, state: dict[str, Any]) -> None:
        self.queue.restore(state)

    async def stats(self) -> dict[str, Any]:
        return self.queue.stats()

    async def close(self) -> None:
        self.queue.close()
