"""The in-process TransferQueue: storage units and per-task controllers in one process.

``LocalQueue`` implements ``QueueClient`` for threads; ``AsyncLocalQueue`` wraps the same state as
``AsyncQueueClient`` for asyncio code. Both may be used at once. One lock guards all state; a
put writes the storage units (row ``i`` on unit ``i % num_storage_units``) and then notifies every
controller of the (rows, columns) it made ready, which wakes waiting readers: a thread waits on
an ``Event``, a coroutine on a future resolved with ``call_soon_threadsafe``. Nothing polls.

Cleared rows are forgotten by storage and controllers; there is no automatic GC, because a task
that consumes a row may still write columns to it (its output) after every other task is done,
and a late write would resurrect a half row. The driver clears rows at step boundaries
(``clear()`` frees every row all registered tasks consumed). Indices must never be reused.

It deliberately does not cross process boundaries (see ``ray_backend``), does not copy object
values on put (lists of numbers are packed, other objects are stored by reference) and does not
bound memory.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.api.queue import Batch, Policy, RowMeta, StorageUnit
from sluice.queue.controller import TaskController, Waiter
from sluice.queue.storage import (
    InMemoryStorageUnit,
    group_by_columns,
    merge_snapshots,
    partition,
    scatter_back,
    select_rows,
    split_snapshot,
)

logger = logging.getLogger(__name__)


def check_put(indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None) -> None:
    """Reject malformed puts before any unit is written (shared by both backends)."""
    if len(set(indices)) != len(indices):
        raise ValueError("duplicate indices in one put")
    for name, values in columns.items():
        if len(values) != len(indices):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(indices)} rows")
    if meta is not None and [m.index for m in meta] != list(indices):
        raise ValueError("meta must be aligned with indices (meta[k].index == indices[k])")


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def needed(batch_size: int, min_size: int | None, closed: bool, deadline: float | None) -> int:
    """Rows a get needs before it returns: ``min_size`` (default ``batch_size``), 0 once it may not wait."""
    if min_size is not None and not 0 <= min_size <= batch_size:
        raise ValueError(f"need 0 <= min_size ({min_size}) <= batch_size ({batch_size})")
    if closed or (deadline is not None and time.monotonic() >= deadline):
        return 0
    return batch_size if min_size is None else min_size


def resolve(fut: asyncio.Future[None]) -> None:
    """Complete a waiter's future (idempotent)."""
    if not fut.done():
        fut.set_result(None)


class LocalQueue:
    """Thread-safe in-process TransferQueue (implements ``sluice.api.queue.QueueClient``)."""

    def __init__(
        self, num_storage_units: int = 1, unit_factory: Callable[[], StorageUnit] = InMemoryStorageUnit
    ) -> None:
        if num_storage_units < 1:
            raise ValueError("num_storage_units must be >= 1")
        self._units: list[StorageUnit] = [unit_factory() for _ in range(num_storage_units)]
        self._controllers: dict[str, TaskController] = {}
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
            for unit in self._units:
                bootstrap(ctl, unit.catalog())

    def put(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> None:
        check_put(indices, columns, meta)
        names = list(columns)
        shares = [  # packed outside the lock
            (
                unit,
                [indices[p] for p in positions],
                select_rows(columns, positions, pack=True),
                None if meta is None else [meta[p] for p in positions],
            )
            for unit, positions in partition(indices, len(self._units)).items()
        ]
        with self._lock:
            for unit, sub_indices, sub_columns, sub_meta in shares:
                metas = self._units[unit].write(sub_indices, sub_columns, sub_meta)
                for ctl in self._controllers.values():
                    ctl.notify_ready(metas, names)

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
    ) -> Batch:
        deadline = deadline_of(timeout)
        event = threading.Event()
        waiter = event.set
        while True:
            event.clear()
            batch = self.attempt(task, columns, batch_size, policy, indices, min_size, deadline, waiter)
            if batch is not None:
                return batch
            try:
                event.wait(remaining(deadline))
            finally:
                self.unwatch(task, waiter)

    def attempt(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        policy: str | Policy,
        indices: Sequence[int] | None,
        min_size: int | None,
        deadline: float | None,
        waiter: Waiter,
    ) -> Batch | None:
        """One selection attempt; if it must wait, ``waiter`` is registered in the same critical section."""
        with self._lock:
            batch = self._take(task, columns, batch_size, policy, indices, min_size, deadline)
            if batch is None:
                self._controller(task).add_waiter(waiter)
            return batch

    def unwatch(self, task: str, waiter: Waiter) -> None:
        with self._lock:
            self._controller(task).remove_waiter(waiter)

    def _take(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        policy: str | Policy,
        indices: Sequence[int] | None,
        min_size: int | None,
        deadline: float | None,
    ) -> Batch | None:
        """Select, mark consumed and read the rows (lock held); ``None`` means not enough yet."""
        need = needed(batch_size, min_size, self._closed, deadline)
        metas = self._controller(task).select(columns, batch_size, policy, indices, need)
        if metas is None:
            return None
        chosen = [m.index for m in metas]
        positions = partition(chosen, len(self._units))
        parts = {u: self._units[u].read([chosen[p] for p in pos], columns) for u, pos in positions.items()}
        data = scatter_back(parts, positions, columns, len(chosen))
        return Batch(indices=tuple(chosen), columns=data, meta=tuple(metas))

    def _controller(self, task: str) -> TaskController:
        ctl = self._controllers.get(task)
        if ctl is None:
            raise KeyError(f"task {task!r} is not registered")
        return ctl

    def clear(self, indices: Sequence[int] | None = None) -> int:
        with self._lock:
            if indices is None:
                consumed = [ctl.consumed for ctl in self._controllers.values()]
                indices = sorted(set.intersection(*consumed)) if consumed else []
            dropped = 0
            for unit, positions in partition(indices, len(self._units)).items():
                dropped += self._units[unit].drop([indices[p] for p in positions])
            for ctl in self._controllers.values():
                ctl.forget(indices)
            return dropped

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "storage": merge_snapshots([unit.snapshot() for unit in self._units]),
                "tasks": {task: ctl.snapshot() for task, ctl in self._controllers.items()},
            }

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            for unit, part in zip(self._units, split_snapshot(state["storage"], len(self._units)), strict=True):
                unit.restore(part)
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
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> None:
        self.queue.put(indices, columns, meta)

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
    ) -> Batch:
        loop = asyncio.get_running_loop()
        deadline = deadline_of(timeout)
        while True:
            fut: asyncio.Future[None] = loop.create_future()

            def waiter(fut: asyncio.Future[None] = fut) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(resolve, fut)

            batch = self.queue.attempt(task, columns, batch_size, policy, indices, min_size, deadline, waiter)
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
